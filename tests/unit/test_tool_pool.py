"""Tool calls in the reward worker pool: a hang, a crash and an exception each become a counted error
observation of their own kind; the other calls are answered and the pool is polled without blocking."""

from __future__ import annotations

import pytest

from rlhf.agent.runner import SerialTools, ToolPool, make_tool_runner
from rlhf.agent.tools import read_tool_config

TOOL = '''
import os, time
from rlhf.agent.tools import Tool

class Moody(Tool):
    schema = {"type": "function", "function": {"name": "moody", "parameters": {"type": "object",
              "properties": {"mode": {"type": "string"}}, "required": ["mode"]}}}

    def __call__(self, mode):
        if mode == "hang":
            time.sleep(3600)
        if mode == "crash":
            os._exit(3)
        if mode == "raise":
            raise ValueError("nope")
        if mode.startswith("gate:"):  # answers once the file named after the colon exists
            while not os.path.exists(mode[5:]):
                time.sleep(0.01)
            return "OPEN"
        return mode.upper()
'''


def moody_and_calculator(d):
    """The specs of a tools yaml in ``d`` with the Moody test tool and the calculator."""
    (d / "moody.py").write_text(TOOL)
    (d / "tools.yaml").write_text(f"tools:\n  - class_name: {d / 'moody.py'}:Moody\n  - class_name: calculator\n")
    return read_tool_config(str(d / "tools.yaml"))


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    return moody_and_calculator(tmp_path_factory.mktemp("moody"))


def test_failures_are_observations_of_their_kind_and_the_rest_is_answered(specs):
    with ToolPool(specs, num_workers=2, timeout_s=1.0) as pool:
        modes = ["ok", "hang", "crash", "raise", "fine"]
        tickets = [pool.submit("moody", {"mode": m}) for m in modes] + [pool.submit("calculator", {"expression": "6*7"})]
        got = {}
        while len(got) < len(tickets):
            for t in pool.wait_any([t for t in tickets if t not in got]):
                got[t] = pool.take(t)
        res = [got[t] for t in tickets]
        assert [r.error for r in res] == [None, "timeout", "crash", "tool_error", None, None]
        assert res[0].text == "OK" and res[4].text == "FINE" and res[5].text == "42"
        assert "timed out after 1 s (rollout.multi_turn.tool_timeout_s)" in res[1].text
        assert "tool worker died (exit code 3)" in res[2].text
        assert "raised ValueError: nope" in res[3].text
        assert pool.restarts == 2
        assert pool.take(pool.submit("moody", {"mode": "again"})).text == "AGAIN"  # replaced workers serve


def test_polling_does_not_block(specs, tmp_path):
    gate = tmp_path / "gate"
    with ToolPool(specs, num_workers=1, timeout_s=30) as pool:
        t = pool.submit("moody", {"mode": f"gate:{gate}"})
        assert pool.wait_any([t], 0) == [] and not pool.done(t)  # returns while the call runs
        gate.touch()
        assert pool.wait_any([t]) == [t] and pool.done(t)
        assert pool.take(t).text == "OPEN"


def test_in_process_runner(specs):
    runner = make_tool_runner(specs, num_workers=0, timeout_s=1.0, label="x")
    assert isinstance(runner, SerialTools)
    t = runner.submit("moody", {"mode": "raise"})
    assert runner.wait_any([t], 0) == [t] and runner.take(t).error == "tool_error"
