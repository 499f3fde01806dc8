"""The agent loop: the sampler's :class:`rlhf.rollout.turns.TurnHandler` for tool-using rollouts.

One :class:`AgentLoop` serves one ``generate`` call. When a row's assistant turn ends, the
turn's tokens (everything after the last observation) are decoded and parsed for Hermes tool
calls. No call: the trajectory ends. Calls: they are checked against the tool schemas and
submitted to the tool runner (a malformed, unknown or badly-argued call is answered at once
with its error), and the sampler parks the row, keeping its KV blocks. ``poll`` hands back
the rows whose calls have all answered, each with its tool-response turn rendered to token
ids (:class:`rlhf.agent.format.ObservationFormat`); the sampler appends them to the same
sequence and decoding continues. The trajectory is one training sample whose response mask
is 0 on those observation tokens.

Limits (verl's names): ``max_assistant_turns`` ends a trajectory at that many assistant turns
(its last turn's calls are not run), ``max_user_turns`` at that many observations, and only
the first ``max_parallel_calls`` calls of a turn run.

Under a tensor-parallel rollout (``tp_group``) every peer parses the same tokens to the same
calls, but only the group's first rank runs tools; ``poll`` broadcasts its results, so every
peer returns identical observations in identical order (the sampler's lockstep rule).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from rlhf.agent.format import ObservationFormat
from rlhf.agent.parser import ERROR_KINDS, CallError, check_call, parse_tool_calls
from rlhf.agent.runner import ToolResult, ToolRunner


@dataclass
class _Row:
    turns: int = 0  # assistant turns ended
    observations: int = 0
    turn_start: int = 0  # response position where the current assistant turn starts


@dataclass
class _Waiting:
    items: list  # per call: a runner ticket (int), or the ToolResult already known
    last_token: int  # the token the turn ended with
    length: int  # trajectory length at the turn end
    names: list = field(default_factory=list)  # the called tools' names, per item


@dataclass
class AgentCounts:
    """What one generate call's tools did, on this rollout replica."""

    calls: int = 0
    errors: dict = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))


def summed_counts(tallies: list[dict]) -> AgentCounts:
    """One :class:`AgentCounts` from tallies ``{"calls": int, "errors": {kind: int}}`` (e.g. per group)."""
    out = AgentCounts()
    for t in tallies:
        out.calls += t["calls"]
        for k, v in t["errors"].items():
            out.errors[k] += v
    return out


class AgentLoop:
    """TurnHandler of one generate call (see the module docstring).

    Args:
        tokenizer: decodes turns and renders observations (through ``fmt``).
        runner: where tools run; None on TP peers that only receive results.
        fmt: renders tool results as a tool-response turn.
        schemas: ``tool name -> OpenAI function schema``.
        max_assistant_turns, max_user_turns, max_parallel_calls: ``rollout.multi_turn`` limits.
        tp_group, tp_src: a tensor-parallel rollout's group and the global rank that runs tools.
    """

    def __init__(self, tokenizer: Any, runner: Optional[ToolRunner], fmt: ObservationFormat, schemas: dict[str, dict],
                 *, max_assistant_turns: Optional[int] = None, max_user_turns: Optional[int] = None,
                 max_parallel_calls: int = 1, tp_group: Any = None, tp_src: int = 0) -> None:
        self.tokenizer, self.runner, self.fmt, self.schemas = tokenizer, runner, fmt, schemas
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.tp_group, self.tp_src = tp_group, tp_src
        self.rows: dict[int, _Row] = collections.defaultdict(_Row)
        self.waiting: dict[int, _Waiting] = {}
        self.counts = AgentCounts()
        self.prompt_infos: list = []  # the replica chunk's prompts: (key, extra_info), row = prompt * n + sample
        self.n = 1
        self.step_rewards: dict[tuple, dict[str, list[float]]] = {}  # (prompt key, sample) -> tool -> rewards
        self.orphans: list[int] = []  # tickets of calls whose rows were aborted (rlhf.rollout.abort)

    def set_prompts(self, keys: list, extra_infos: list, n: int) -> None:
        """The prompts of the sampler's rows (called by the engine before generating): their per-sample
        tool kwargs (verl's ``extra_info.tools_kwargs``) and the keys the step rewards are filed under."""
        self.prompt_infos, self.n = list(zip(keys, extra_infos)), n

    def counts_of(self, row: int) -> AgentCounts:
        """Where row ``row``'s tool calls and errors are counted (one tally per generate call here)."""
        return self.counts

    def _create_kwargs(self, row: int, name: str) -> dict:
        if not self.prompt_infos:
            return {}
        info = self.prompt_infos[row // self.n][1]
        kw = (info or {}).get("tools_kwargs") or {}
        return dict(((kw.get(name) or {}).get("create_kwargs")) or {})

    # ------------------------------------------------------------------ TurnHandler

    def turn_ended(self, row: int, response: list[int]) -> bool:
        st = self.rows[row]
        st.turns += 1
        text = self.tokenizer.decode(response[st.turn_start:], skip_special_tokens=False)
        calls = parse_tool_calls(text)
        if not calls:
            return False
        if (self.max_assistant_turns is not None and st.turns >= self.max_assistant_turns) or \
                (self.max_user_turns is not None and st.observations >= self.max_user_turns):
            return False
        calls = calls[:self.max_parallel_calls]
        self.counts_of(row).calls += len(calls)
        items: list[Union[int, ToolResult, None]] = []
        names: list[str] = []
        for call in calls:
            call = check_call(call, self.schemas)
            names.append(getattr(call, "name", ""))
            if isinstance(call, CallError):  # answered at once
                items.append(ToolResult(call.message, call.kind))
            elif self.runner is not None:
                items.append(self.runner.submit(call.name, call.arguments, self._create_kwargs(row, call.name)))
            else:
                items.append(None)  # a TP peer: the result comes from the group's first rank
        self.waiting[row] = _Waiting(items, response[-1], len(response), names)
        return True

    def abandon(self, rows: list[int]) -> None:
        """Over-sampling aborted ``rows`` while they waited for tools: forget them; their calls' tickets are
        kept in ``orphans`` for the agent to collect (a result never taken would stay in the pool)."""
        for row in rows:
            w = self.waiting.pop(row, None)
            if w is not None:
                self.orphans.extend(t for t in w.items if isinstance(t, int))

    def poll(self, wait: bool) -> list[tuple[int, list[int]]]:
        ready = self._ready(wait) if self.runner is not None else None
        if self.tp_group is not None:
            import torch.distributed as dist

            box = [ready]
            dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
            ready = box[0]
        out = []
        for row, results in ready:
            w = self.waiting.pop(row)
            st = self.rows[row]
            for name, r in zip(w.names, results):
                if r.error is not None:
                    self.counts_of(row).errors[r.error] += 1
                if r.reward is not None and self.prompt_infos:
                    key = (self.prompt_infos[row // self.n][0], row % self.n)
                    self.step_rewards.setdefault(key, {}).setdefault(name, []).append(r.reward)
            ids = self.fmt.ids([r.text for r in results], w.last_token)
            st.observations += 1
            st.turn_start = w.length + len(ids)
            out.append((row, ids))
        return out

    # ------------------------------------------------------------------ tool results

    def _ready(self, wait: bool) -> list[tuple[int, list[ToolResult]]]:
        """Rows whose calls have all answered, with their results (in row order); with ``wait``,
        blocks until there is at least one."""
        while True:
            tickets = [t for w in self.waiting.values() for t in w.items if isinstance(t, int)]
            done = set(self.runner.wait_any(tickets, 0)) if tickets else set()
            ready = []
            for row in sorted(self.waiting):
                items = self.waiting[row].items
                if all(not isinstance(t, int) or t in done for t in items):
                    ready.append((row, [self.runner.take(t) if isinstance(t, int) else t for t in items]))
            if ready or not wait or not self.waiting:
                return ready
            self.runner.wait_any([t for t in tickets if t not in done])
