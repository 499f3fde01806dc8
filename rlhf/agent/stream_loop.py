"""The agent loop of a fully_async rollout rank (``rlhf.rollout.stream.StreamRun``): group slots reused.

A :class:`~rlhf.rollout.stream.StreamRun` owns ``groups`` group slots; slot ``g`` holds output
rows ``[g*n, (g+1)*n)`` and takes a new prompt each time its group finishes. So the loop's
per-row state (turn counts, the current turn's start) is reset when a slot starts a prompt
(:meth:`StreamAgentLoop.begin_group`), and what colocated mode tallies per generate call (tool
calls and errors, tool step rewards) is tallied per slot and handed over with the finished group
(:meth:`StreamAgentLoop.end_group`), so it travels with the group's rows to the training role.
"""

from __future__ import annotations

from typing import Any

from rlhf.agent.loop import AgentCounts, AgentLoop


class StreamAgentLoop(AgentLoop):
    """:class:`AgentLoop` over reusable group slots (see the module docstring); ``n`` samples per prompt."""

    def __init__(self, *args: Any, groups: int, n: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.n = n
        # step rewards are filed under (slot, prompt key): a prompt may be in two slots at once (two epochs)
        self.prompt_infos = [((g, None), None) for g in range(groups)]
        self.slot_counts = [AgentCounts() for _ in range(groups)]

    def counts_of(self, row: int) -> AgentCounts:
        return self.slot_counts[row // self.n]

    def begin_group(self, g: int, key: int, extra_info: Any) -> None:
        """Slot ``g`` starts the prompt with dataset key ``key`` (``extra_info``: its tools' kwargs)."""
        for q in range(g * self.n, (g + 1) * self.n):
            self.rows.pop(q, None)
        self.prompt_infos[g] = ((g, key), extra_info)
        self.slot_counts[g] = AgentCounts()

    def end_group(self, g: int) -> dict:
        """Slot ``g``'s group finished: its tool calls, errors per kind and each sample's step rewards
        (``{tool name: [rewards]}``, verl's ``rollout_reward_scores``)."""
        c = self.slot_counts[g]
        own = self.prompt_infos[g][0]
        rewards = [self.step_rewards.pop((own, j), {}) for j in range(self.n)]
        return {"calls": c.calls, "errors": dict(c.errors), "step_rewards": rewards}
