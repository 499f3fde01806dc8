"""StreamRun with multi-turn tool trajectories (trainer.mode fully_async + rollout.multi_turn): parked
trajectories stream out with their observation holes, equal to one batched multi-turn generate, and a
weight load with ``recompute`` re-prefills parked ones under the new weights."""

from __future__ import annotations

from collections import defaultdict

import torch

from rlhf.rollout import Sampler, SamplingParams
from rlhf.rollout.stream import StreamRun
from tests.unit.test_stream_rollout import PROMPTS, STEP, A, B, Driver, _teacher_forced

CALLS = (5, 9, 13, 21, 40)  # "tool call" stop tokens
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=11, stop_token_ids=list(CALLS))


class Tool:
    """A row's call is answered with ``[60 + L % 4] * (1 + L % 3)`` (``L``: its response length), at most
    2 per trajectory, one observation per poll: a function of the trajectory, not of the row it sits in.
    ``begin_group`` / ``end_group`` as ``rlhf.agent.stream_loop.StreamAgentLoop``'s (a slot reused)."""

    def __init__(self, n: int = PARAMS.n):
        self.n, self.turns, self.pending, self.calls = n, defaultdict(int), {}, defaultdict(int)
        self.log: list[tuple[int, int]] = []  # (slot, response length at the call)

    def begin_group(self, g, key, info):
        for q in range(g * self.n, (g + 1) * self.n):
            self.turns.pop(q, None)
        self.calls[g] = 0

    def end_group(self, g):
        return {"calls": self.calls[g]}

    def turn_ended(self, row, response):
        if response[-1] not in CALLS or self.turns[row] >= 2:
            return False
        self.turns[row] += 1
        self.calls[row // self.n] += 1
        self.log.append((row // self.n, len(response)))
        self.pending[row] = [60 + len(response) % 4] * (1 + len(response) % 3)
        return True

    def poll(self, wait):
        if not self.pending:
            return []
        row = next(iter(self.pending))
        return [(row, self.pending.pop(row))]


class Run(StreamRun):
    def _load(self, version, weights):
        self.parked_with_blocks_at_load = len(self.lot.holding_blocks())
        super()._load(version, weights)


def _run(driver: Driver, tool: Tool, **kw) -> dict:
    s = Sampler(A.config, A.state_dict(), pad_token_id=0, max_num_seqs=3)
    run = Run(s, PARAMS, groups=2, driver=driver, max_prompt_len=8, turns=tool, **kw)
    stats = run.execute()
    stats["parked_at_load"] = getattr(run, "parked_with_blocks_at_load", 0)
    assert sorted(driver.groups) == list(range(len(PROMPTS)))
    return stats


_PLAIN: list = []


def _plain() -> tuple[Driver, Tool, dict]:
    """The tool run without a weight load (shared by the tests that compare against it)."""
    if not _PLAIN:
        d, tool = Driver(), Tool()
        _PLAIN.append((d, tool, _run(d, tool)))
    return _PLAIN[0]


def _rows(driver: Driver):
    for i, p in enumerate(PROMPTS):
        g = driver.groups[i]
        for j in range(PARAMS.n):
            n = int(g["lengths"][j])
            yield p, g["response_ids"][j, :n], g["log_probs"][j, :n], g["versions"][j, :n], g["observation"][j, :n]


def test_streamed_tool_trajectories_equal_one_batched_multi_turn_generate():
    batched = Tool(n=PARAMS.n)
    ref = Sampler(A.config, A.state_dict(), pad_token_id=0).generate(PROMPTS, PARAMS, step=STEP, turns=batched,
                                                                    prompt_keys=[10 + i for i in range(5)])
    d, tool, stats = _plain()
    assert stats["turns"] >= 4 and len(tool.log) == len(batched.log)
    assert sum(g["tools"]["calls"] for g in d.groups.values()) == len(tool.log)  # end_group's tally travels
    for i in range(len(PROMPTS)):
        g = d.groups[i]
        for j in range(PARAMS.n):
            row = i * PARAMS.n + j
            n = int(ref.response_lengths[row])
            assert int(g["lengths"][j]) == n
            assert g["response_ids"][j].tolist() == ref.response_ids[row].tolist()
            in_traj = torch.arange(PARAMS.max_new_tokens) < n
            assert torch.equal(in_traj & ~g["observation"][j], ref.response_mask[row])  # the holes
            torch.testing.assert_close(g["log_probs"][j], ref.log_probs[row], atol=1e-5, rtol=0)


def test_recompute_re_prefills_parked_trajectories_under_the_new_weights():
    d, tool = Driver(new=B, push_at=12), Tool()
    stats = _run(d, tool, kv="recompute")
    assert stats["pauses"] == 1 and stats["turns"] >= 4
    assert stats["parked_at_load"] > 0  # a trajectory waiting for its tool, its K/V from the old weights
    split = 0
    for p, r, lp, ver, obs in _rows(d):
        gen = ~obs
        old, new = gen & (ver == 0), gen & (ver == 1)
        assert bool((lp[obs] == 0).all()) and bool((ver[obs] == 0).all())
        split += bool(old.any() and new.any() and obs.any())
        # each sampled token's log-prob under the weights that sampled it, over the stitched trajectory
        torch.testing.assert_close(lp[old], _teacher_forced(A, p, r.tolist())[old], atol=1e-5, rtol=0)
        torch.testing.assert_close(lp[new], _teacher_forced(B, p, r.tolist())[new], atol=1e-5, rtol=0)
    assert split > 0  # a tool trajectory that crossed the weight load


def test_a_pause_with_the_same_weights_changes_no_tool_trajectory():
    """Draws are keyed by position and the tool answers from the trajectory: a weight load (the same
    weights, ``recompute``) that re-prefills live and parked trajectories changes no token."""
    plain = _plain()[0]
    d = Driver(new=A, push_at=12)
    stats = _run(d, Tool(), kv="recompute")
    assert stats["pauses"] == 1 and stats["parked_at_load"] > 0
    for (_, r0, lp0, _, o0), (_, r1, lp1, _, o1) in zip(_rows(plain), _rows(d)):
        assert torch.equal(r0, r1) and torch.equal(o0, o1)
        torch.testing.assert_close(lp0, lp1, atol=1e-5, rtol=0)
