"""Scoring during generation: the sampler reports each sequence as it finishes, and the
scores collected from the pool equal scoring the finished batch in one call."""

from __future__ import annotations

import torch

from rlhf.rewards.pool import RewardPool
from rlhf.rewards.streaming import StreamingScores
from rlhf.rollout.engine import _rows_to_samples
from rlhf.rollout.sampling import SamplingParams
from rlhf.schema.batch import PromptBatch
from tests.unit.test_sampler import _responses, _sampler

REWARD = '''
def reward(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("z"):
        raise ValueError("z")
    out = {"score": float(len(solution_str) % 3) + float(ground_truth), "pred": solution_str[:2]}
    if len(solution_str) % 2:
        out["odd"] = 1.0
    return out
'''


class _CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(97 + t % 26) for t in row) for row in ids]


def test_finished_sequences_are_reported_once_as_they_finish():
    calls: list[tuple[list[int], list[list[int]]]] = []
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=2, stop_token_ids=[5, 9, 17])
    out = _sampler(max_num_seqs=8).generate([[1, 2, 3], [4, 5], [7, 8, 9, 10]], params, step=1,
                                            on_finished=lambda rows, ids: calls.append((rows, ids)))
    seen = {row: ids for rows, ids in calls for row, ids in zip(rows, ids)}
    assert sorted(seen) == list(range(12)) and sum(len(r) for r, _ in calls) == 12
    assert [seen[r] for r in range(12)] == _responses(out)
    assert len(calls) > 1  # sequences of different lengths finish at different decode steps


def test_streamed_scores_equal_one_batch_call(tmp_path):
    (tmp_path / "r.py").write_text(REWARD)
    prompts = PromptBatch(prompt_ids=[[1, 2, 3], [4, 5], [7, 8, 9, 10]], keys=[10, 11, 12],
                          ground_truths=["0", "1", "2"], data_sources=["d"] * 3, extra_infos=[{}] * 3)
    n, tok = 3, _CharTokenizer()
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=16, seed=3, stop_token_ids=[5, 9, 17])
    with RewardPool(f"{tmp_path / 'r.py'}:reward", num_workers=2, timeout_s=30) as pool:
        stream = StreamingScores(pool, tok, prompts)
        out = _sampler(max_num_seqs=8).generate(prompts.prompt_ids, params, step=1, prompt_keys=prompts.keys,
                                                on_finished=_rows_to_samples(stream, 0, n))
        assert len(stream.jobs) > 1
        local = [2, 0]  # this rank's prompts, in its row order
        got = stream.collect(local, n)
        texts = tok.batch_decode(_responses(out))
        rows = [i * n + j for i in local for j in range(n)]
        ref = pool.score([texts[r] for r in rows], [prompts.ground_truths[r // n] for r in rows],
                         ["d"] * len(rows), [{}] * len(rows))
    assert torch.equal(got.scores, ref.scores)
    assert got.preds == ref.preds
    assert set(got.extra_metrics) == set(ref.extra_metrics)
    for key, values in ref.extra_metrics.items():
        assert [str(v) for v in got.extra_metrics[key]] == [str(v) for v in values], key  # NaN-aware
