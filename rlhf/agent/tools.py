"""Tools the policy can call: the registry, the tool config file, argument checks (the base class:
:mod:`rlhf.agent.base`, re-exported here).

A tool is a class with an OpenAI function schema and a ``__call__(**arguments) -> str``::

    class Lookup(Tool):
        schema = {"type": "function", "function": {
            "name": "lookup", "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}

        def __call__(self, word: str) -> str:
            ...

Raising :class:`ToolError` (or any exception) turns the call into an error observation that
is counted. Tools are named in ``rollout.multi_turn.tool_config_path``, a yaml file in verl's
shape (``class_name`` is a registered name or ``path/to/file.py:Class``, like reward functions)::

    tools:
      - class_name: calculator
      - class_name: python
        config: {cpu_time_s: 2, memory_mb: 512}
      - class_name: my_tools.py:Lookup
        tool_schema: {...}            # optional: overrides the class's schema

Tools run in worker processes (:class:`rlhf.agent.runner.ToolPool`), which get the specs, not
pickled objects. This module imports neither torch nor the training code.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

# Tool and ToolError are public here (custom tools subclass ``rlhf.agent.tools.Tool``); they are
# defined in base.py so that the built-in tools, which this registry names, do not import the registry.
from rlhf.agent.base import Tool, ToolError  # noqa: F401
from rlhf.schema.config import ConfigError

_REGISTRY: dict[str, Callable[[], type]] = {}


def register_tool(name: str, loader: Callable[[], type]) -> None:
    """Register a tool class under ``name``; ``loader`` returns the class (imported lazily)."""
    _REGISTRY[name] = loader


def _builtin_calculator() -> type:
    from rlhf.agent.calculator import Calculator
    return Calculator


def _builtin_python() -> type:
    from rlhf.agent.sandbox import PythonSandbox
    return PythonSandbox


register_tool("calculator", _builtin_calculator)
register_tool("python", _builtin_python)


def list_tools() -> list[str]:
    return sorted(_REGISTRY)


def _tool_class(spec: str) -> type:
    if ".py:" in spec:
        from rlhf.rewards.registry import load_from_file

        path, name = spec.rsplit(":", 1)
        cls = load_from_file(path, name, what="tool class")
    elif spec in _REGISTRY:
        cls = _REGISTRY[spec]()
    else:
        raise ValueError(f"unknown tool '{spec}'; registered: {list_tools()}, or give path/to/file.py:ClassName")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise TypeError(f"tool '{spec}' is not a subclass of rlhf.agent.tools.Tool")
    return cls


def check_schema(schema: Any, where: str) -> dict:
    """An OpenAI function schema ``{"type": "function", "function": {"name", "parameters", ...}}``."""
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or schema.get("type") != "function" or not isinstance(fn.get("name"), str) \
            or not fn["name"]:
        raise ValueError(f"{where}: a tool schema must look like {{'type': 'function', 'function': "
                         f"{{'name': str, 'description': str, 'parameters': {{...}}}}}}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"{where}: function.parameters must be a JSON schema of type 'object'")
    return schema


# One tool of the config: (class spec, config kwargs, schema). Plain data: it is sent to workers.
ToolSpec = tuple[str, dict, dict]


def read_tool_config(path: str) -> list[ToolSpec]:
    """The tools of a verl-style tool config yaml, checked (each class loads and has a valid schema)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"tool config file not found: {path}")
    data = yaml.safe_load(p.read_text()) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list under 'tools:'")
    specs: list[ToolSpec] = []
    for k, e in enumerate(entries):
        where = f"{path}: tools[{k}]"
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str):
            raise ValueError(f"{where}: each tool needs class_name (a registered name or path/to/file.py:Class)")
        unknown = set(e) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid: class_name, config, tool_schema")
        config = e.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config must be a mapping")
        config = {k2: v for k2, v in config.items() if k2 != "type"}  # verl's `type: native` is implied
        cls = _tool_class(e["class_name"])
        schema = check_schema(e.get("tool_schema") or cls.schema, where)
        specs.append((e["class_name"], config, copy.deepcopy(schema)))
    names = [s[2]["function"]["name"] for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{path}: tool names must be unique, repeated: {dup}")
    return specs


def load_tool_config(path: str, key: str = "rollout.multi_turn.tool_config_path") -> list[ToolSpec]:
    """:func:`read_tool_config` whose every failure is one ConfigError line naming ``key``."""
    try:
        return read_tool_config(path)
    except (OSError, ValueError, TypeError, AttributeError, ImportError, SyntaxError, yaml.YAMLError) as e:
        raise ConfigError(f"{key}: {e}") from None


def tool_schemas(specs: list[ToolSpec]) -> list[dict]:
    """The OpenAI function schemas, for ``apply_chat_template(..., tools=...)``."""
    return [copy.deepcopy(s[2]) for s in specs]


# ----------------------------------------------------------------------------- argument checks

_JSON_TYPES: dict[str, tuple] = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
                                 "array": (list,), "object": (dict,), "null": (type(None),)}


def _type_ok(value: Any, tp: Any) -> bool:
    types = tp if isinstance(tp, list) else [tp]
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # a type this check does not know: left to the tool
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, py):
            return True
    return False


def check_arguments(schema: dict, arguments: Any) -> Optional[str]:
    """Why ``arguments`` do not fit the schema's parameters (required keys, unknown keys when
    ``additionalProperties`` is false, JSON types, enums), or None when they fit."""
    params = schema["function"].get("parameters") or {}
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = params.get("properties") or {}
    missing = [k for k in params.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if key not in props:
            if params.get("additionalProperties", True) is False:
                return f"unknown argument '{key}'; expected {sorted(props)}"
            continue
        p = props[key]
        if "type" in p and not _type_ok(value, p["type"]):
            return f"argument '{key}' must be of type {p['type']}, got {type(value).__name__}"
        if "enum" in p and value not in p["enum"]:
            return f"argument '{key}' must be one of {p['enum']}, got {value!r}"
    return None


class ToolSet:
    """The tools of a config, instantiated (in a worker process, or in-process with num_workers 0)."""

    def __init__(self, specs: list[ToolSpec]) -> None:
        self.tools: dict[str, Tool] = {}
        for class_spec, config, schema in specs:
            try:
                tool = _tool_class(class_spec)(**config)
            except TypeError as e:
                raise ValueError(f"tool '{class_spec}': bad config {config}: {e}") from None
            self.tools[schema["function"]["name"]] = tool

    def run(self, name: str, arguments: dict, create_kwargs: Optional[dict] = None) -> tuple:
        """``(observation text, None)`` (``(text, None, step reward)`` when the tool gave one), or
        ``(error message, "tool_error")`` when the tool failed. ``create_kwargs``: the trajectory's
        per-sample kwargs (:meth:`Tool.execute`)."""
        reward = None
        try:
            out = self.tools[name].execute(arguments, dict(create_kwargs or {}))
            if isinstance(out, tuple) and len(out) == 2:
                out, reward = out
                reward = float(reward)
        except ToolError as e:
            return str(e), "tool_error"
        except Exception as e:  # the tool's own failure is the model's observation, never the run's end
            return f"error: tool '{name}' raised {type(e).__name__}: {e}", "tool_error"
        if not isinstance(out, str):
            return f"error: tool '{name}' returned {type(out).__name__}, not a string", "tool_error"
        return (out, None) if reward is None else (out, None, reward)

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()
