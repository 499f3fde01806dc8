"""Multi-turn generation (``Sampler.generate(turns=...)``) with a fake deterministic tool."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from rlhf.rollout import SamplingParams
from tests.unit.test_sampler import PROMPTS, _model, _sampler

CALLS = (57, 27, 32)  # "tool call" stop tokens (frequent under the test model)
EOS = 17
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=3, stop_token_ids=[*CALLS, EOS])


class FakeTool:
    """After a CALL token (at most ``max_turns`` per row) the row waits for the observation
    ``[60 + (row + turn) % 4] * (1 + (row + turn) % 3)``, released after ``delay`` polls
    (one per poll when delayed; the oldest when the sampler must wait)."""

    def __init__(self, max_turns: int = 2, delay: int = 0, length: int | None = None):
        self.max_turns, self.delay, self.length = max_turns, delay, length
        self.turns: dict[int, int] = defaultdict(int)
        self.pending: dict[int, list] = {}
        self.log: list[tuple[int, int, list[int]]] = []  # (row, response length at the call, observation)

    def observation(self, row: int, turn: int) -> list[int]:
        k = (row + turn) % 3 + 1 if self.length is None else self.length
        return [60 + (row + turn) % 4] * k

    def turn_ended(self, row: int, response: list[int]) -> bool:
        if response[-1] not in CALLS or self.turns[row] >= self.max_turns:
            return False
        self.turns[row] += 1
        obs = self.observation(row, self.turns[row])
        self.pending[row] = [obs, self.delay]
        self.log.append((row, len(response), obs))
        return True

    def poll(self, wait: bool) -> list[tuple[int, list[int]]]:
        ready = []
        for row, item in self.pending.items():
            item[1] -= 1
            if item[1] < 0:
                ready.append(row)
        if self.delay:
            ready = ready[:1]
        if wait and not ready:
            ready = [next(iter(self.pending))]
        return [(r, self.pending.pop(r)[0]) for r in ready]


def _holes(tool: FakeTool, out) -> torch.Tensor:
    """``[N, R]`` True where the tool's observations went (cut to max_new_tokens)."""
    R = out.response_ids.shape[1]
    holes = torch.zeros(out.response_ids.shape, dtype=torch.bool)
    for row, start, obs in tool.log:
        holes[row, start:min(R, start + len(obs))] = True
    return holes


def test_multi_turn_logprobs_match_hf_on_the_stitched_trajectory():
    tool = FakeTool()
    out = _sampler().generate(PROMPTS, PARAMS, turns=tool)
    assert out.stats["turns"] >= 4 and out.stats["observation_tokens"] > 0
    holes = _holes(tool, out)
    R = PARAMS.max_new_tokens
    within = torch.arange(R)[None, :] < out.response_lengths[:, None]
    # (c) the mask's holes are exactly where the observations are, with their tokens
    assert torch.equal(out.response_mask, within & ~holes)
    for row, start, obs in tool.log:
        assert out.response_ids[row, start - 1] in CALLS
        assert out.response_ids[row, start:start + len(obs)].tolist() == obs[:R - start]
    assert (out.log_probs[~out.response_mask] == 0).all()
    assert out.stats["tokens_generated"] == out.response_mask.sum()
    # (a) generated tokens' log-probs = HF forward over prompt + stitched trajectory
    model = _model()
    for row in range(out.response_ids.shape[0]):
        p, n = PROMPTS[row // 2], int(out.response_lengths[row])
        traj = out.response_ids[row, :n].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([p + traj])).logits[0, len(p) - 1 : len(p) + n - 1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(traj)[:, None]).squeeze(1)
        m = out.response_mask[row, :n]
        torch.testing.assert_close(out.log_probs[row, :n][m], ref[m], atol=1e-4, rtol=0)
    # a row that stops on EOS (or a call past max_turns) finishes; no row stops on a call it was answered
    for row in range(out.response_ids.shape[0]):
        n = int(out.response_lengths[row])
        if not out.truncated[row]:
            assert out.response_ids[row, n - 1] == EOS or tool.turns[row] == tool.max_turns


def test_multi_turn_tokens_independent_of_tool_timing_and_cache_pressure():
    ref_tool = FakeTool()
    ref = _sampler(max_num_seqs=16).generate(PROMPTS, PARAMS, turns=ref_tool)
    assert ref.stats["preemptions"] == 0
    for kw, delay in (({"max_num_seqs": 16}, 3), ({"max_num_seqs": 3}, 1),
                      ({"max_num_seqs": 16, "kv_cache_tokens": 64, "block_size": 8}, 2),
                      ({"max_num_seqs": 16, "kv_cache_tokens": 96, "block_size": 8}, 0)):
        tool = FakeTool(delay=delay)
        out = _sampler(**kw).generate(PROMPTS, PARAMS, turns=tool)
        if "kv_cache_tokens" in kw:
            assert out.stats["preemptions"] > 0 and out.stats["kv_peak_tokens"] <= kw["kv_cache_tokens"]
        assert sorted(tool.log) == sorted(ref_tool.log), kw
        for f in ("response_ids", "response_mask", "response_lengths", "truncated"):
            assert torch.equal(getattr(out, f), getattr(ref, f)), (kw, f)
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_parked_sequences_are_preempted_under_cache_pressure():
    """A slow tool keeps many rows parked with their blocks; the decoding ones need them."""
    ref = _sampler(max_num_seqs=16).generate(PROMPTS, PARAMS, turns=FakeTool())
    s = _sampler(max_num_seqs=16, kv_cache_tokens=64, block_size=8)
    out = s.generate(PROMPTS, PARAMS, turns=FakeTool(delay=50))
    assert out.stats["parked_preemptions"] > 0
    assert torch.equal(out.response_ids, ref.response_ids)
    assert s.cache.num_free == s.cache.num_blocks  # every block returned


def test_observation_cut_to_the_room_left_and_row_truncated():
    tool = FakeTool(max_turns=1, length=100)
    finished: dict[int, list[int]] = {}
    out = _sampler().generate(PROMPTS, PARAMS, turns=tool, on_finished=lambda rows, ids: finished.update(zip(rows, ids)))
    R = PARAMS.max_new_tokens
    assert tool.log
    for row, start, obs in tool.log:  # the observation fills the trajectory: no room to generate
        assert out.response_lengths[row] == R and out.truncated[row]
        assert not out.response_mask[row, start:].any() and out.response_mask[row, :start].all()
        assert finished[row] == out.response_ids[row].tolist()
    assert sorted(finished) == list(range(len(PROMPTS) * 2))
    assert out.stats["observation_tokens"] == sum(R - start for _, start, _ in tool.log)


def test_bad_observations_are_named():
    class Wrong(FakeTool):
        def poll(self, wait):
            return [(999, [1])]

    with pytest.raises(ValueError, match="row 999, which is not waiting"):
        _sampler().generate(PROMPTS, PARAMS, turns=Wrong())

    class Silent(FakeTool):
        def poll(self, wait):
            return []

    with pytest.raises(RuntimeError, match="returned no observation"):
        _sampler().generate(PROMPTS, PARAMS, turns=Silent())

    class OutOfVocab(FakeTool):
        def observation(self, row, turn):
            return [64]

    with pytest.raises(ValueError, match="outside the vocabulary"):
        _sampler().generate(PROMPTS, PARAMS, turns=OutOfVocab())


def test_engine_keeps_the_holes_through_exchange_and_to_batch():
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.schema.batch import PromptBatch
    from rlhf.schema.config import RolloutConfig

    tok = build_char_tokenizer()
    model = _model()
    prompts = PromptBatch(prompt_ids=PROMPTS[:3], keys=[5, 6, 7], ground_truths=["", "", ""],
                          data_sources=["x"] * 3, extra_infos=[{}] * 3)
    engine = RolloutEngine(RolloutConfig(n=2, seed=3), tok, max_prompt_length=8, max_response_length=40,
                           device=torch.device("cpu"))
    engine._stop_ids, engine._stop_seqs = [*CALLS, EOS], []
    tool = FakeTool()
    batch, stats = engine.sample(model.state_dict(), model.config, prompts, step=0, n=2, temperature=1.0, turns=tool)
    assert stats["rollout/turns"] == len(tool.log) > 0
    holes = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    for row, start, obs in tool.log:
        holes[row, start:start + len(obs)] = True
        assert batch.responses[row, start:start + len(obs)].tolist() == obs
    in_traj = batch.attention_mask[:, 8:].bool()
    assert torch.equal(batch.response_mask.bool(), in_traj & ~holes)
    assert (batch.rollout_log_probs[holes] == 0).all()
    # the all-gather path (local_rows): same rows, holes kept
    tool2 = FakeTool()
    swapped, _ = engine.sample(model.state_dict(), model.config, prompts, step=0, n=2, temperature=1.0,
                               local_rows=[2, 0], turns=tool2)
    for f in ("responses", "response_mask", "attention_mask", "rollout_log_probs"):
        assert torch.equal(getattr(swapped, f), torch.cat([getattr(batch, f)[4:6], getattr(batch, f)[0:2]])), f
