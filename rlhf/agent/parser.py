"""Tool calls in an assistant turn, in the Qwen / Hermes format.

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234*5678"}}</tool_call>

Every ``<tool_call>`` block becomes a :class:`ToolCall` or, when it cannot be one, a
:class:`CallError` with a kind (for the metrics) and the message the model reads as the
observation. ``arguments`` may also be a JSON-encoded object (some models write a string).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Union

from rlhf.agent.tools import check_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)

# Kinds of failed calls, a fixed list so every rank logs the same metric keys.
ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "timeout", "crash", "tool_error")


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class CallError:
    kind: str  # one of ERROR_KINDS
    message: str  # the observation the model reads

    def __post_init__(self) -> None:
        assert self.kind in ERROR_KINDS, self.kind


def has_tool_call(text: str) -> bool:
    return OPEN in text


def _parse_block(body: str, closed: bool) -> Union[ToolCall, CallError]:
    if not closed:
        return CallError("parse", f"error: {OPEN} without {CLOSE}")
    try:
        obj: Any = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return CallError("parse", f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError("parse", 'error: a tool call must be {"name": <tool name>, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return CallError("parse", f"error: the arguments string is not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return CallError("bad_arguments", f"error: arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[Union[ToolCall, CallError]]:
    """The tool calls of ``text`` in order (``[]`` when it has none)."""
    out = []
    for m in _BLOCK.finditer(text):
        closed = m.group(0).endswith(CLOSE)
        out.append(_parse_block(m.group(1), closed))
    return out


def check_call(call: Union[ToolCall, CallError], schemas: dict[str, dict]) -> Union[ToolCall, CallError]:
    """``call`` checked against the tools' schemas (``name -> OpenAI function schema``)."""
    if isinstance(call, CallError):
        return call
    if call.name not in schemas:
        return CallError("unknown_tool", f"error: unknown tool '{call.name}'; available: {', '.join(sorted(schemas))}")
    why = check_arguments(schemas[call.name], call.arguments)
    if why is not None:
        return CallError("bad_arguments", f"error: bad arguments for '{call.name}': {why}")
    return call
