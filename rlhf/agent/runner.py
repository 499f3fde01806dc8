"""Where tool calls run: worker processes with a per-call timeout, or (num_workers 0) this process.

Both runners have one interface, which the agent loop polls without blocking::

    ticket = runner.submit(name, arguments)
    runner.wait_any(tickets, timeout)  -> finished tickets (timeout 0: just look)
    runner.take(ticket)                -> ToolResult
    runner.close()

:class:`ToolPool` is the reward worker pool (:class:`rlhf.rewards.pool.RewardPool`) with tool
workers: a call that runs past ``timeout_s`` has its worker killed and replaced, a worker
that dies is replaced; either way the call's observation is an error, counted under
``timeout`` / ``crash``. A tool that raises answers with its error (``tool_error``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from rlhf.agent.tools import ToolSet, ToolSpec
from rlhf.rewards.pool import RewardPool


@dataclass
class ToolResult:
    text: str  # the observation
    error: Optional[str] = None  # None, or a kind of rlhf.agent.parser.ERROR_KINDS
    reward: Optional[float] = None  # the tool's step reward (Tool.execute), if it gave one


class ToolRunner(Protocol):
    def submit(self, name: str, arguments: dict, create_kwargs: Optional[dict] = None) -> int: ...

    def wait_any(self, tickets: Sequence[int], timeout: Optional[float] = None) -> list[int]: ...

    def take(self, ticket: int) -> ToolResult: ...

    def close(self) -> None: ...


class ToolCollector:
    """The outcome of one tool call in the pool (the pool's collector protocol: ok / fail / result)."""

    def __init__(self) -> None:
        self.outcome: Optional[ToolResult] = None

    def ok(self, i: int, text: str, error: Optional[str], reward: Optional[float] = None) -> None:
        self.outcome = ToolResult(text, error, reward)

    def fail(self, i: int, msg: str, *, timeout: bool = False) -> None:
        self.outcome = ToolResult(f"error: the tool call {msg}" if timeout else f"error: {msg}",
                                  "timeout" if timeout else "crash")

    def result(self) -> ToolResult:
        assert self.outcome is not None
        return self.outcome


class ToolPool(RewardPool):
    """``num_workers`` tool processes (fresh interpreters loading the tools of ``specs``)."""

    role = "tool"
    worker_module = "rlhf.agent.tool_worker"
    timeout_key = "rollout.multi_turn.tool_timeout_s"

    def __init__(self, specs: list[ToolSpec], *, num_workers: int, timeout_s: float, label: str = "tools") -> None:
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError(f"a tool pool needs num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self._start(label, ("init_tools", specs), num_workers, timeout_s)

    def _init_error(self, message: str) -> str:
        return f"tool worker could not load the tools of {self.spec}: {message}"

    def submit(self, name: str, arguments: dict, create_kwargs: Optional[dict] = None) -> int:  # type: ignore[override]
        return self._enqueue([(name, arguments, create_kwargs or {})], ToolCollector())

    def take(self, ticket: int) -> ToolResult:
        return self.result(ticket)


class SerialTools:
    """The tools in this process (no timeout, a crash ends the run): for debugging and tests."""

    def __init__(self, specs: list[ToolSpec]) -> None:
        self.tools = ToolSet(specs)
        self._done: dict[int, ToolResult] = {}
        self._ids = itertools.count()

    def submit(self, name: str, arguments: dict, create_kwargs: Optional[dict] = None) -> int:
        ticket = next(self._ids)
        self._done[ticket] = ToolResult(*self.tools.run(name, arguments, create_kwargs))
        return ticket

    def wait_any(self, tickets: Sequence[int], timeout: Optional[float] = None) -> list[int]:
        return list(tickets)

    def take(self, ticket: int) -> ToolResult:
        return self._done.pop(ticket)

    def close(self) -> None:
        self.tools.close()


def make_tool_runner(specs: list[ToolSpec], *, num_workers: int, timeout_s: float, label: str) -> ToolRunner:
    if num_workers == 0:
        return SerialTools(specs)
    return ToolPool(specs, num_workers=num_workers, timeout_s=timeout_s, label=label)
