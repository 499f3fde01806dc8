"""Tools: the calculator, the tool config file, argument checks, and the Hermes tool-call parser."""

from __future__ import annotations

import pytest

from rlhf.agent.calculator import Calculator, evaluate
from rlhf.agent.parser import CallError, ToolCall, check_call, parse_tool_calls
from rlhf.agent.tools import ToolError, ToolSet, check_arguments, load_tool_config, read_tool_config
from rlhf.config.load import load_config
from rlhf.schema.config import ConfigError

USER_TOOLS = '''
from rlhf.agent.tools import Tool, ToolError

class Echo(Tool):
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object",
              "properties": {"text": {"type": "string"}, "times": {"type": "integer", "enum": [1, 2]}},
              "required": ["text"], "additionalProperties": False}}}

    def __init__(self, prefix=""):
        self.prefix = prefix

    def __call__(self, text, times=1):
        if text == "boom":
            raise RuntimeError("exploded")
        if text == "refuse":
            raise ToolError("error: I refuse")
        return self.prefix + text * times
'''


@pytest.fixture
def tool_file(tmp_path):
    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    return tmp_path / "my_tools.py"


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("expr, want", [("1234*5678", "7006652"), ("2**10 - 3", "1021"), ("7/2", "3.5"),
                                        ("6/3", "2"), ("-(3+4)*2", "-14"), ("17 // 5 + 17 % 5", "5"),
                                        ("sqrt(16) + abs(-2)", "6"), ("max(3, 9, 4)", "9"), ("0.1+0.2", "0.3")])
def test_calculator_values(expr, want):
    assert Calculator()(expression=expr) == want


@pytest.mark.parametrize("expr, message", [
    ("1/0", "division by zero"), ("9**9**9", "exponent"), ("__import__('os').system('ls')", "unsupported"),
    ("x + 1", "name 'x'"), ("'a' * 3", "unsupported"), ("2 +", "invalid expression"), ("1e308 * 10", "finite"),
    ("sqrt(-1)", "sqrt"), ("(10**999) * (10**999)", "1000 digits"), ("1" * 600, "longer than"),
])
def test_calculator_rejects_with_a_message(expr, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expr)


def test_tool_config_builtins_user_class_and_schema_override(tmp_path, tool_file):
    path = _config(tmp_path, f"""
tools:
  - class_name: calculator
    config: {{type: native}}
  - class_name: {tool_file}:Echo
    config: {{prefix: ">"}}
    tool_schema:
      type: function
      function: {{name: shout, parameters: {{type: object, properties: {{text: {{type: string}}}}}}}}
""")
    specs = read_tool_config(path)
    assert [s[2]["function"]["name"] for s in specs] == ["calculator", "shout"]
    tools = ToolSet(specs)
    assert tools.run("calculator", {"expression": "6*7"}) == ("42", None)
    assert tools.run("shout", {"text": "hi"}) == (">hi", None)
    assert tools.run("shout", {"text": "refuse"}) == ("error: I refuse", "tool_error")
    text, kind = tools.run("shout", {"text": "boom"})
    assert kind == "tool_error" and "RuntimeError: exploded" in text


@pytest.mark.parametrize("body, message", [
    ("tools:\n  - class_name: nope\n", "unknown tool 'nope'"),
    ("tools: []\n", "non-empty list under 'tools:'"),
    ("tools:\n  - class_name: calculator\n    extra: 1\n", "unknown keys \\['extra'\\]"),
    ("tools:\n  - class_name: calculator\n  - class_name: calculator\n", "unique"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {name: calc}\n", "must look like"),
    ("tools:\n  - class_name: MISSING.py:Echo\n", "tool class file not found"),
])
def test_bad_tool_configs_fail_with_one_line_naming_the_key(tmp_path, body, message):
    with pytest.raises(ConfigError, match="rollout.multi_turn.tool_config_path: .*" + message):
        load_tool_config(_config(tmp_path, body))


def test_user_tool_class_missing_lists_the_classes(tmp_path, tool_file):
    with pytest.raises(ConfigError, match=r"tool class 'Nope' not found .* classes there: \['Echo'\]"):
        load_tool_config(_config(tmp_path, f"tools:\n  - class_name: {tool_file}:Nope\n"))


def test_multi_turn_config_is_checked():
    base = ["model.path=m", "data.train_files=t"]
    cfg = load_config(None, base + ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=t.yaml",
                                    "rollout.multi_turn.max_assistant_turns=3"])
    assert cfg.rollout.multi_turn.max_assistant_turns == 3 and cfg.rollout.multi_turn.max_user_turns is None
    for bad, key in ((["rollout.multi_turn.enable=true"], "tool_config_path"),
                     (["rollout.multi_turn.max_parallel_calls=0"], "max_parallel_calls"),
                     (["rollout.multi_turn.tool_response_truncate_side=top"], "tool_response_truncate_side")):
        over = base + ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=t.yaml"] + bad
        if key == "tool_config_path":
            over = base + bad
        with pytest.raises(ConfigError, match=key):
            load_config(None, over)


SCHEMAS = {"echo": {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer", "enum": [1, 2]}},
    "required": ["text"], "additionalProperties": False}}}}


@pytest.mark.parametrize("args, why", [
    ({"text": "a"}, None), ({"text": "a", "times": 2}, None), ({}, "missing required"),
    ({"text": 3}, "must be of type string"), ({"text": "a", "times": True}, "must be of type integer"),
    ({"text": "a", "times": 3}, "must be one of"), ({"text": "a", "loud": 1}, "unknown argument 'loud'"),
])
def test_check_arguments(args, why):
    got = check_arguments(SCHEMAS["echo"], args)
    assert (got is None) if why is None else (why in got)


def test_parser_reads_hermes_calls_and_names_each_failure():
    text = ('I will compute.<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
            '<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"x\\"}"}\n</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": 1}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": echo}</tool_call><tool_call>["echo"]</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "cut')
    calls = [check_call(c, SCHEMAS) for c in parse_tool_calls(text)]
    assert calls[0] == ToolCall("echo", {"text": "hi"}) and calls[1] == ToolCall("echo", {"text": "x"})
    kinds = [c.kind for c in calls[2:]]
    assert kinds == ["bad_arguments", "unknown_tool", "bad_arguments", "parse", "parse", "parse"]
    assert all(isinstance(c, CallError) and c.message.startswith("error: ") for c in calls[2:])
    assert "unknown tool 'calc'; available: echo" in calls[3].message
    assert "without </tool_call>" in calls[-1].message
    assert parse_tool_calls("#### 42") == []


def test_shipped_tool_configs_and_quickstart_configs_load():
    from pathlib import Path

    from rlhf.train.sft import SFTConfig, validate_sft

    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "configs" / "tools").glob("*.yaml")):
        assert read_tool_config(str(path))
    cfg = load_config(str(root / "configs" / "quickstart_tools.yaml"))
    assert cfg.rollout.multi_turn.enable and (root / cfg.rollout.multi_turn.tool_config_path).is_file()
    sft = load_config(str(root / "configs" / "quickstart_tools_sft.yaml"), cls=SFTConfig, check=validate_sft)
    assert sft.sft.tool_config_path == cfg.rollout.multi_turn.tool_config_path
