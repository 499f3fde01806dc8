"""Reward functions by name or by ``path/to/file.py:function_name``.

Every reward function has verl's signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None)
        -> float | dict   # a dict holds "score"; its other numeric keys become metrics

Built-ins: ``gsm8k`` (strict ``#### <number>``), ``gsm8k_flexible`` (last number),
``exact_match``, ``math`` (last ``\\boxed{}`` judged by math-verify), ``math_dapo``
(DAPO's ``Answer:`` line, +1 / -1) and ``default`` (dispatch on ``data_source`` like
verl's ``default_compute_score``). A user function is loaded from a file, as verl's
``custom_reward_function.path`` / ``.name`` do; ``reward_kwargs`` are bound to it
(verl's ``custom_reward_function.reward_kwargs``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from rlhf.rewards.gsm8k import gsm8k, gsm8k_flexible
from rlhf.rewards.match import exact_match
from rlhf.rewards.math_answer import math_verify_score
from rlhf.rewards.math_dapo import math_dapo

RewardFn = Callable[..., "float | dict[str, Any]"]

# data_source -> reward function used by "default".
DATA_SOURCE_REWARDS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k,
    "synthetic/addition": gsm8k,
    "synthetic/shapes": gsm8k,  # the vision-language quickstart (rlhf.data.shapes): "#### <count>"
    "lighteval/MATH": math_verify_score,
    "DigitalLearningGmbH/MATH-lighteval": math_verify_score,
    "HuggingFaceH4/MATH-500": math_verify_score,
    "math_dapo": math_dapo,
    # verl scores geo3k 0.9 x accuracy (the \boxed{} answer) + 0.1 x the <think> format; here: accuracy only
    "hiyouga/geometry3k": math_verify_score,
}
# data_source prefixes, as verl routes every "aime..." source to the DAPO scorer.
DATA_SOURCE_PREFIX_REWARDS: dict[str, RewardFn] = {"aime": math_dapo}


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Pick the reward function from ``data_source`` (see ``DATA_SOURCE_REWARDS``)."""
    fn = DATA_SOURCE_REWARDS.get(data_source)
    if fn is None:
        fn = next((f for p, f in DATA_SOURCE_PREFIX_REWARDS.items() if data_source.startswith(p)), None)
    if fn is None:
        raise NotImplementedError(
            f"no default reward for data_source '{data_source}'; known: {sorted(DATA_SOURCE_REWARDS)} "
            f"and prefixes {sorted(DATA_SOURCE_PREFIX_REWARDS)}. "
            f"Set the reward function by name or as path/to/file.py:function_name"
        )
    return fn(data_source, solution_str, ground_truth, extra_info, **kwargs)


_REGISTRY: dict[str, RewardFn] = {
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "exact_match": exact_match,
    "math": math_verify_score,
    "math_dapo": math_dapo,
    "default": default_compute_score,
}


def register_reward_fn(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under ``name``."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward function '{name}' is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def list_reward_fns() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def load_from_file(path_str: str, name: str, what: str = "reward function") -> Any:
    """The attribute ``name`` of the python file ``path_str`` (a user reward function or tool class)."""
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    # A name derived from the absolute path: two files with the same stem do not collide.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    module_name = f"rlhf_user_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {what} file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses / pickling inside the file work
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        want_class = what.endswith("class")
        available = sorted(
            n for n, o in vars(module).items()
            if callable(o) and not n.startswith("_") and inspect.isclass(o) == want_class
            and getattr(o, "__module__", None) == module_name
        )
        raise AttributeError(f"{what} '{name}' not found in {path}; {'classes' if want_class else 'callables'} "
                             f"there: {available}")
    return obj


def get_reward_fn(spec: str, reward_kwargs: dict[str, Any] | None = None) -> RewardFn:
    """Resolve a reward function.

    Args:
        spec: a registered name (see :func:`list_reward_fns`), ``path/to/file.py:function_name``,
            or ``path/to/file.py`` (function ``compute_score``, verl's default name).
        reward_kwargs: keyword arguments bound to the function (e.g. ``{"format_score": 0.1}``).

    Raises:
        ValueError: unknown name (the message lists the registered names).
        FileNotFoundError / AttributeError: the file or the function in it is missing.
        TypeError: ``reward_kwargs`` holds a keyword the function does not take.
    """
    if spec.endswith(".py"):
        fn = load_from_file(spec, "compute_score")
    elif ".py:" in spec:
        path_str, fn_name = spec.rsplit(":", 1)
        fn = load_from_file(path_str, fn_name)
    elif spec in _REGISTRY:
        fn = _REGISTRY[spec]
    else:
        raise ValueError(
            f"unknown reward function '{spec}'; registered: {list_reward_fns()}, "
            f"or give path/to/file.py:function_name"
        )
    if reward_kwargs:
        try:  # a misspelt keyword must fail here, not score every sample 0 as an error
            inspect.signature(fn).bind_partial(**reward_kwargs)
        except TypeError as e:
            raise TypeError(f"reward.reward_kwargs {sorted(reward_kwargs)} do not fit {spec}: {e}") from None
        fn = functools.partial(fn, **reward_kwargs)
    return fn
