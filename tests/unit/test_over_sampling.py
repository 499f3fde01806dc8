"""rollout.over_sample_rate: verl's abort rule in the sampler, the started count, and the prompt backlog."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf.data.backlog import PromptBacklog, started_prompts
from rlhf.data.loader import PromptLoader
from rlhf.rollout import SamplingParams
from rlhf.rollout.abort import estimated_saved_s
from rlhf.rollout.exchange import pack_rows, unpack_rows
from tests.unit.test_sampler import PROMPTS, _sampler
from tests.unit.test_sampler_turns import FakeTool, PARAMS as TURN_PARAMS

PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=2, stop_token_ids=[5, 9, 17, 27, 32, 57])


@pytest.mark.parametrize("need,rate,want", [(256, 0.1, 285), (8, 0.25, 11), (8, 0.0, 8), (4, 0.5, 8), (10, 0.1, 12)])
def test_started_prompts_is_the_fewest_whose_kept_share_fills_the_batch(need, rate, want):
    # verl aborts once int((1 - rate) * started) have finished: that share must reach `need`, one fewer must not
    t = started_prompts(need, rate)
    assert t == want
    assert int(t * (1 - rate) + 1e-9) >= need and (rate == 0 or int((t - 1) * (1 - rate) + 1e-9) < need)


def test_saved_seconds_estimate_from_the_finished_lengths():
    # aborted at 5 tokens: the finished longer than 5 (8, 12) end at 10 on average -> 5 steps; at 13: none longer
    # -> the cap 16 -> 3 steps; the slowest decides: 5 steps x 0.5 s
    assert estimated_saved_s([2, 8, 12], [5, 13], 16, 0.5) == pytest.approx(2.5)
    assert estimated_saved_s([2, 8], [], 16, 0.5) == 0.0


def _group_ends(out, n: int) -> list[int]:
    """Decode step at which each prompt's last sample finished (all admitted at once: its longest sample)."""
    return out.response_lengths.view(-1, n).max(1).values.tolist()


@pytest.mark.parametrize("keep", [1, 2])
def test_sampler_aborts_once_keep_groups_are_done(keep):
    full = _sampler(max_num_seqs=64).generate(PROMPTS, PARAMS)
    ends = _group_ends(full, 3)
    assert len(set(ends)) > 2, "want groups that end at different steps"
    s = _sampler(max_num_seqs=64)
    out = s.generate(PROMPTS, PARAMS, keep_groups=keep)
    kept = sorted(range(len(PROMPTS)), key=lambda p: ends[p])
    cut = ends[kept[keep - 1]]
    want = [ends[p] > cut for p in range(len(PROMPTS))]  # every group done by the step the keep-th one ended
    assert out.aborted.view(-1, 3).all(1).tolist() == want and out.aborted.view(-1, 3).any(1).tolist() == want
    assert out.stats["aborted"] == sum(want) and out.stats["over_sample_saved_s"] >= 0
    done = ~out.aborted
    for f in ("response_ids", "response_lengths", "truncated"):  # kept groups: the tokens of the full run
        assert torch.equal(getattr(out, f)[done], getattr(full, f)[done]), f
    assert out.stats["decode_steps"] < full.stats["decode_steps"]  # the tail was not decoded
    again = s.generate(PROMPTS, PARAMS)  # every KV block came back (start() checks it)
    assert torch.equal(again.response_ids, full.response_ids) and again.aborted is None


def test_abort_with_parked_tool_calls_frees_their_blocks():
    full = _sampler(max_num_seqs=64).generate(PROMPTS, TURN_PARAMS, turns=FakeTool(delay=3))
    s = _sampler(max_num_seqs=64)
    out = s.generate(PROMPTS, TURN_PARAMS, turns=FakeTool(delay=3), keep_groups=2)
    done = ~out.aborted
    assert 0 < int(out.aborted.sum()) and int(done.sum()) >= 2 * TURN_PARAMS.n
    assert torch.equal(out.response_ids[done], full.response_ids[done])
    assert torch.equal(out.response_mask[done], full.response_mask[done])  # holes where the observations went
    again = s.generate(PROMPTS, TURN_PARAMS, turns=FakeTool(delay=3))
    assert torch.equal(again.response_ids, full.response_ids)


def test_aborted_flag_travels_through_the_row_exchange():
    out = _sampler(max_num_seqs=64).generate(PROMPTS, PARAMS, keep_groups=2)
    back = unpack_rows(pack_rows(out, out.response_ids.shape[0], 16, torch.device("cpu")), 16, 3)
    assert back.aborted.any()
    assert torch.equal(back.aborted, out.aborted) and torch.equal(back.truncated, out.truncated)


def _run_epoch(rate: float, seed: int, steps: int, need: int = 8, size: int = 40):
    """Trained prompts per step when a random share of the started prompts is aborted each step."""
    backlog = PromptBacklog(PromptLoader(size, need, seed=0))
    rng = random.Random(seed)
    trained = []
    for _ in range(steps):
        started = backlog.take(started_prompts(need, rate))
        done = [p for p in started if rng.random() > rate]
        while len(done) < need:  # a replica waits until its share is done: at least `need` finish
            done.append(next(p for p in started if p not in done))
        used = [p for p in started if p in done][:need]
        backlog.give_back([p for p in started if p not in used])
        trained.append(used)
    return trained, backlog


def test_an_epoch_trains_every_prompt_once_as_without_over_sampling():
    plain, _ = _run_epoch(0.0, 0, 5)
    over, backlog = _run_epoch(0.25, 1, 5)
    flat = [p for b in over for p in b]
    assert len(flat) == len(set(flat)) == 40  # none repeated
    assert sorted(flat) == sorted(p for b in plain for p in b) == list(range(40))  # none lost: the same fingerprint
    assert flat != [p for b in plain for p in b]  # (the order differs: aborted prompts came later)
    assert len(backlog.waiting) < started_prompts(8, 0.25)  # only the last step's unused wait for epoch 1


def test_given_back_prompts_survive_a_checkpoint():
    a = PromptBacklog(PromptLoader(40, 8, seed=3))
    a.take(11)
    a.give_back([5, 7])
    state = a.state_dict()
    b = PromptBacklog(PromptLoader(40, 8, seed=3))
    b.load_state_dict(state)
    assert b.waiting == a.waiting and b.waiting[:2] == [5, 7]
    assert [b.take(11) for _ in range(6)] == [a.take(11) for _ in range(6)]
    with pytest.raises(ValueError, match="batch_size"):  # the loader's own checks still apply
        PromptBacklog(PromptLoader(40, 4, seed=3)).load_state_dict(state)


def test_settle_keeps_the_first_finished_groups_and_gives_the_rest_back():
    from rlhf.schema.batch import RolloutBatch
    from rlhf.train.over_sampling import OverSampling

    over = OverSampling(PromptLoader(40, 4, seed=0), 0.25, 4, dp_rank=0, dp=1)
    started, rows = over.draw()
    assert len(started) == 6 and rows == list(range(6))
    n = 2
    index = torch.tensor(started).repeat_interleave(n)
    aborted = torch.tensor([False, False, True, True, False, False, False, False, True, True, False, False])
    batch = RolloutBatch(input_ids=index[:, None].repeat(1, 3), attention_mask=torch.ones(12, 3, dtype=torch.long),
                         responses=index[:, None], response_mask=torch.ones(12, 1), index=index,
                         rollout_log_probs=torch.zeros(12, 1), truncated=torch.zeros(12, dtype=torch.bool),
                         response_texts=[f"t{i}" for i in range(12)], aborted=aborted)
    kept, used, metrics = over.settle(batch, started, rows, n)
    # positions 1 and 4 aborted; of 0, 2, 3, 5 finished the first 4 are used, none left over
    assert used == [started[p] for p in (0, 2, 3, 5)]
    assert kept.index.tolist() == [u for u in used for _ in range(n)]  # whole groups, rows in order
    assert kept.response_texts == [f"t{r}" for r in (0, 1, 4, 5, 6, 7, 10, 11)] and kept.aborted is None
    assert over.backlog.waiting[:2] == [started[1], started[4]]  # given back first, in data order
    assert metrics == {"rollout/over_sample_started": 6.0, "rollout/over_sample_returned": 2.0}


def test_aborted_tool_calls_are_collected_by_a_later_call():
    from rlhf.agent.loop import AgentLoop, _Waiting
    from rlhf.agent.rollout import ToolAgent
    from rlhf.agent.runner import ToolResult

    class Runner:  # tickets 1 and 2 out; 1 finished
        def __init__(self):
            self.results = {1: ToolResult("x")}

        def wait_any(self, tickets, timeout=None):
            return [t for t in tickets if t in self.results]

        def take(self, t):
            return self.results.pop(t)

    runner = Runner()
    loop = AgentLoop(None, runner, None, {})
    loop.waiting[4] = _Waiting([1, ToolResult("answered at once")], 0, 3, ["a", "b"])
    loop.waiting[6] = _Waiting([2], 0, 5, ["a"])
    loop.abandon([4, 6])
    assert loop.waiting == {} and loop.orphans == [1, 2]
    agent = object.__new__(ToolAgent)
    agent.runner, agent._last_loop, agent._orphans = runner, loop, []
    agent._collect_orphans()
    assert runner.results == {} and agent._orphans == [2]  # 1 taken; 2 still running: looked at next call
    runner.results[2] = ToolResult("late")
    agent._collect_orphans()
    assert runner.results == {} and agent._orphans == []
