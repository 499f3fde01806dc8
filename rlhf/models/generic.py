"""Which path a causal LM runs on: the fast functional decoder, the generic HF-module path, or refused.

The sampler has two ways to run a model (``rlhf.rollout.generic`` explains the second):

* **fast**: the hand-ported families of ``rlhf.models.arch`` (``SUPPORTED_MODEL_TYPES``), run by the
  functional decoder ``rlhf.models.decoder`` over fused weights;
* **generic**: any other ``AutoModelForCausalLM`` whose attention goes through transformers'
  ``AttentionInterface``: the HF module runs its own forward and our attention function reads and
  writes the paged KV cache.

:func:`rollout_path` decides from the config alone (no weights, no model built), so the decision and
its one-line reason come at start-up. A model is refused only where the generic path would compute
something else than HF: its attention bypasses ``AttentionInterface`` (e.g. ALiBi biases added in the
module), its layers keep state besides K/V (convolution / recurrent caches of hybrids, which the
generic sampler does not hold per slot yet), its masks say more than causal + sliding window
(chunked, indexed / compressed sparse attention, bidirectional), or it is not a decoder-only model.

``python -m rlhf.models.generic`` prints the markdown table of every ``model_type`` transformers
ships with a causal-LM head and its path (docs/howto/any-model.md holds its output).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.models.family_checks import EQUAL, REFUSED, UNCHECKED

FAST, GENERIC = "fast", "generic"
# attention layer types whose mask the generic path builds itself (causal, with the layer's window)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# names a modeling file uses for per-layer state besides K/V (Mamba / Gated DeltaNet / short-conv hybrids)
_STATE_PATTERN = re.compile(r"conv_state|recurrent_state|ssm_state|cache_params|LinearAttention|short_conv")


@dataclass(frozen=True)
class RolloutPath:
    """The path a model runs on and why (``reason``: why it is not on the fast path; "" when it is)."""

    path: str  # FAST or GENERIC
    reason: str

    def startup_line(self, model_type: str, slowdown: float | None = None) -> str:
        """The one line printed at start-up: which path, and (generic) how much slower it measured."""
        if self.path == FAST:
            return f"rollout: {model_type} runs on the fast path (functional decoder, rlhf.models.decoder)"
        speed = (f"; it measured {slowdown:.1f}x slower than the fast path on a tiny qwen2 (bench/generic_path.py)"
                 if slowdown else "")
        return (f"rollout: {model_type} runs on the generic path (its HF modules, paged attention through "
                f"AttentionInterface: rlhf.rollout.generic){speed}; not fast because {self.reason}")


# tokens/s of the fast path / the generic path on the same tiny qwen2 (hidden 256, 4 layers, 16 x 64 new
# tokens, fp32), bench/generic_path.py on the 2-core shared CPU, 2026-11-28 (docs/howto/any-model.md).
# Printed at start-up beside a generic model's path; measure again on your hardware.
GENERIC_SLOWDOWN = 1.2


def _causal_lm_names() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.lru_cache(maxsize=None)
def causal_lm_class(model_type: str) -> type | None:
    """transformers' causal-LM class of ``model_type`` (imports its modeling module), or None."""
    name = _causal_lm_names().get(model_type)
    if name is None:
        return None
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):
        return None


def _modeling_source(cls: type) -> str:
    module = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def _fast_refusal(config: Any, max_seq_len: int | None = None) -> str | None:
    """Why the functional decoder cannot run ``config`` (None: it can)."""
    from rlhf.models.arch import SUPPORTED_MODEL_TYPES, VL_TEXT_FAMILY
    from rlhf.models.decoder import check_supported

    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES + tuple(VL_TEXT_FAMILY):
        return "it is not one of the hand-ported fast families (rlhf.models.arch)"
    try:
        check_supported(config, max_seq_len)
    except NotImplementedError as e:
        return str(e).removeprefix("rollout sampler: ")
    return None


def generic_refusal(config: Any) -> str | None:
    """Why the generic path cannot run ``config`` exactly (None: it can), in one line."""
    model_type = getattr(config, "model_type", None)
    cls = causal_lm_class(model_type)
    if cls is None:
        return f"model_type {model_type!r} has no causal-LM head in transformers (MODEL_FOR_CAUSAL_LM_MAPPING)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model; the sampler runs decoder-only LMs"
    text = getattr(config, "text_config", None) or config
    types = set(getattr(text, "layer_types", None) or ())
    other = sorted(t for t in types if t not in ATTENTION_LAYER_TYPES)
    if _STATE_PATTERN.search(_modeling_source(cls)) or any("linear" in t or "mamba" in t or "conv" in t for t in other):
        what = f"{', '.join(other)} layers" if other else "Mamba, linear attention or short convolutions"
        return (f"{model_type}'s layers keep convolution / recurrent state ({what}); the generic sampler holds only "
                f"the paged K/V cache per slot")
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"{cls.__name__}'s attention does not go through transformers' AttentionInterface "
                f"(_supports_attention_backend=False), so the paged cache cannot be plugged in")
    if other:
        return (f"{model_type} has {', '.join(other)} layers, whose attention masks the generic path does not "
                f"build (it builds causal and sliding-window masks)")
    if getattr(text, "attention_chunk_size", None):
        return f"{model_type} uses chunked attention (attention_chunk_size), whose mask the generic path does not build"
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        return f"{model_type} is configured with bidirectional attention: not a causal LM"
    if model_type in REFUSED:
        return f"{model_type}: {REFUSED[model_type]} (scripts/generic_survey.py)"
    return None


def rollout_path(config: Any, max_seq_len: int | None = None) -> RolloutPath:
    """The path of ``config`` (see the module docstring) for sequences up to ``max_seq_len``; raises
    NotImplementedError with the one-line reason for a refused model."""
    fast_reason = _fast_refusal(config, max_seq_len)
    if fast_reason is None:
        return RolloutPath(FAST, "")
    refusal = generic_refusal(config)
    if refusal is not None:
        raise NotImplementedError(f"rollout sampler: {refusal}")
    return RolloutPath(GENERIC, fast_reason)


def is_generic(config: Any) -> bool:
    return rollout_path(config).path == GENERIC


# --------------------------------------------------------------------------- training: decoder blocks


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder blocks of any HF causal LM, found generically: the ``ModuleList`` whose members are
    of a class named in the model's ``_no_split_modules`` (what transformers itself never splits
    across devices), else the longest ``ModuleList`` of one module class. None if there is none."""
    no_split: set[str] = set()
    for m in model.modules():
        no_split.update(getattr(m, "_no_split_modules", None) or ())
    best: list[torch.nn.Module] | None = None
    for m in model.modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) == 0:
            continue
        kinds = {type(x).__name__ for x in m}
        if kinds & no_split:
            return list(m)
        if len(kinds) == 1 and (best is None or len(m) > len(best)):
            best = list(m)
    return best


# --------------------------------------------------------------------------- the family table


def _tiny_config(model_type: str) -> Any:
    """The default config of ``model_type`` (what the table classifies: the family's defaults)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def classify(model_type: str) -> tuple[str, str]:
    """(path, reason) of a family at its default config: path is FAST, GENERIC or "refused"."""
    try:
        config = _tiny_config(model_type)
    except Exception as e:  # noqa: BLE001 - a family whose config cannot be built is reported, not fatal
        return "refused", f"its default config does not build ({type(e).__name__})"
    try:
        p = rollout_path(config)
    except NotImplementedError as e:
        return "refused", str(e).removeprefix("rollout sampler: ")
    return p.path, p.reason


def family_table(model_types: list[str] | None = None, tested: tuple[str, ...] = ()) -> str:
    """Markdown table: every causal-LM ``model_type`` of transformers, its path, the reason, and for the
    generic path whether it was checked equal to HF (``tested``: by the test suite; else by the survey)."""
    import transformers

    rows = [f"Generated by `python -m rlhf.models.generic` from transformers {transformers.__version__}.", "",
            "| model_type | path | checked equal to HF | why (not fast / refused) |", "|---|---|---|---|"]
    for t in model_types or sorted(_causal_lm_names()):
        path, reason = classify(t)
        checked = ""
        if path == GENERIC:
            checked = ("yes: tests/unit/test_generic_rollout.py" if t in tested
                       else "yes: tiny config, scripts/generic_survey.py" if t in EQUAL
                       else f"not checked ({UNCHECKED.get(t, 'no survey result')})")
        elif path == FAST:
            checked = "yes: the fast families' tests"
        rows.append(f"| `{t}` | {path} | {checked} | {reason.replace('|', '/')} |")
    return "\n".join(rows)


# families the tests run end to end on the generic path (tests/unit/test_generic_rollout.py)
TESTED_GENERIC = ("granite", "exaone4", "seed_oss", "olmo3", "smollm3", "gemma4_text", "deepseek_v2")

if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(family_table(tested=TESTED_GENERIC))
