"""Loading the run configuration: yaml + dotted CLI overrides -> the typed :class:`Config`.

The steps of :func:`load_config`: read the yaml, apply the overrides, translate verl's key names
(:mod:`rlhf.config.verl`), resolve Hub model names (:mod:`rlhf.config.hub`), build the dataclasses
with type checks (unknown keys name the nearest valid ones, :mod:`rlhf.config.hints`), then check
values (:mod:`rlhf.config.checks`). The schema itself is :mod:`rlhf.schema.config`, below every layer.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from rlhf.config.checks import validate
from rlhf.config.hints import near_keys
from rlhf.config.hub import resolve_hub_names
from rlhf.config.verl import hydra_yaml, translate
from rlhf.schema.config import Config, ConfigError

def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and gently coerce) `value` against annotation `tp`; returns (ok, value)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return value in typing.get_args(tp), value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp is list or origin is list:
        if isinstance(value, tuple):
            value = list(value)
        return isinstance(value, list), value
    if tp is dict or origin is dict:
        return isinstance(value, dict), value
    return isinstance(value, tp), value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: dict, prefix: str, root: type | None = None) -> Any:
    root = root or cls
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            near = near_keys(root, prefix, str(key), names)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint} (valid keys in "
                              f"'{prefix.rstrip('.') or 'config'}': {', '.join(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp, value, dotted = hints[f.name], data[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value if value is not None else {}, dotted + ".", root)
            continue
        args = typing.get_args(tp)
        if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            if not isinstance(value, dict):  # named sections (distill.teachers.<name>)
                raise ConfigError(f"config key '{dotted}' must be a mapping of names to sections, got {value!r}")
            kwargs[f.name] = {str(k): _build(args[1], v if v is not None else {}, f"{dotted}.{k}.", root)
                              for k, v in value.items()}
            continue
        ok, value = _type_ok(value, tp)
        if not ok:
            raise ConfigError(f"config key '{dotted}' must be {_type_name(tp)}, got {data[f.name]!r}")
        kwargs[f.name] = value
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``actor.lr=1e-6`` -> (["actor", "lr"], 1e-6); the value is parsed as yaml."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())
        raise ConfigError(f"override '{text}': the value {raw!r} is not valid yaml ({why[:160]}); "
                          f"quote it for the shell, e.g. '{key}=[a, b]'") from None
    # yaml reads 1e-6 as a string (no dot); accept it as a float.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in "e.") and value.strip() else value
        except ValueError:
            pass
    return key.strip().split("."), value


def _set_dotted(tree: dict, keys: list[str], value: Any) -> None:
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{'.'.join(keys)}': '{k}' is not a section")
    node[keys[-1]] = value


def _fix_yaml_floats(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _fix_yaml_floats(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fix_yaml_floats(v) for v in tree]
    if isinstance(tree, str):
        try:
            if any(c in tree.lower() for c in "e") and tree.strip()[0] in "0123456789.-+":
                return float(tree)
        except ValueError:
            pass
    return tree


# verl spellings accepted for our keys: (section, verl key) -> (section, key).
ALIASES = {("actor", "ulysses_sequence_parallel_size"): ("parallel", "sp"),
           ("parallel", "ulysses_sequence_parallel_size"): ("parallel", "sp")}


def _apply_aliases(tree: dict) -> None:
    for (sec, key), (dsec, dkey) in ALIASES.items():
        node = tree.get(sec)
        if not isinstance(node, dict) or key not in node:
            continue
        value = node.pop(key)
        dest = tree.setdefault(dsec, {})
        if dkey in dest and dest[dkey] != value:
            raise ConfigError(f"config keys '{sec}.{key}' ({value!r}) and its alias '{dsec}.{dkey}' "
                              f"({dest[dkey]!r}) disagree; set one of them")
        dest[dkey] = value


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = (), *,
                cls: type = Config, check=None) -> Any:
    """Read a yaml file (optional), apply dotted overrides, type-check and validate.

    `cls` is the root dataclass (Config for RL, SFTConfig for SFT); `check` its validator
    (default: :func:`rlhf.config.checks.validate`).
    """
    tree: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid yaml: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections (model:, data:, "
                              f"actor:, ...), got a {type(tree).__name__}")
        tree = _fix_yaml_floats(tree)
        tree = hydra_yaml(tree, p)  # verl's yaml shape: hydra: ignored, defaults: resolved
    for ov in overrides:
        keys, value = parse_override(ov)
        _set_dotted(tree, keys, value)
    tree = translate(tree, cls)  # verl's key names -> ours (README: "Coming from verl")
    resolve_hub_names(tree)
    _apply_aliases(tree)
    cfg = _build(cls, tree, "")
    if check is None:
        check = validate
    check(cfg)
    return cfg
