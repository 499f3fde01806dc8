"""Score responses while the sampler still decodes the others (colocated mode).

Rollouts have a long tail: most sequences finish well before the longest. With a reward
worker pool (``reward.num_workers > 0``), each batch of sequences that finish at a decode
step is decoded to text and submitted to the pool at once, so the reward function runs
in the worker processes during the rest of generation instead of in a phase after it.

Each rollout replica scores the rows it generated, which are not the rows its rank
trains on (the engine deals rows out after generation), so the per-row results are
exchanged over the replicas once generation ends; error and timeout counts stay with
the replica that scored them (their sums over ranks are the same). The result equals
scoring the finished batch in one call: same texts, same function.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from rlhf.models.parallel import all_gather_object
from rlhf.rewards.pool import RewardPool
from rlhf.rewards.scoring import ScoreResult


class StreamingScores:
    """The ``on_finished`` hook of one generation call and the collection of its scores."""

    def __init__(self, pool: RewardPool, tokenizer, prompts):
        """``prompts``: the global :class:`rlhf.schema.batch.PromptBatch` being generated."""
        self.pool, self.tokenizer, self.prompts = pool, tokenizer, prompts
        self.jobs: list[tuple[list[tuple[int, int]], int]] = []  # (rows, pool ticket)

    def __call__(self, rows: list[tuple[int, int]], token_ids: list[list[int]]) -> None:
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        p = self.prompts
        ticket = self.pool.submit(texts, [p.ground_truths[i] for i, _ in rows], [p.data_sources[i] for i, _ in rows],
                                  [p.extra_infos[i] for i, _ in rows])
        self.jobs.append((rows, ticket))

    def collect(self, local_rows: list[int], n: int, group=None) -> ScoreResult:
        """The scores of this rank's rows (``local_rows``: prompt positions, ``n`` samples each, in
        the batch's row order), gathered from the replicas that scored them over ``group``."""
        mine: dict[tuple[int, int], tuple] = {}
        n_errors = n_timeouts = n_untried = 0
        first_error: Optional[str] = None
        for rows, ticket in self.jobs:
            res = self.pool.result(ticket)
            n_errors, n_timeouts = n_errors + res.n_errors, n_timeouts + res.n_timeouts
            n_untried += res.n_untried
            first_error = first_error or res.first_error
            for k, row in enumerate(rows):
                extras = {key: values[k] for key, values in res.extra_metrics.items()}
                mine[row] = (float(res.scores[k]), extras, res.preds[k] if res.preds else None)
        merged: dict[tuple[int, int], tuple] = {}
        for piece in all_gather_object(mine, group):
            merged.update(piece)
        order = [(i, j) for i in local_rows for j in range(n)]
        missing = [row for row in order if row not in merged]
        if missing:
            raise RuntimeError(f"streamed scores: no score for {len(missing)} rows, e.g. {missing[0]}")
        keys = sorted({key for row in order for key in merged[row][1]})
        return ScoreResult(
            scores=torch.tensor([merged[row][0] for row in order], dtype=torch.float32),
            extra_metrics={key: [merged[row][1].get(key, math.nan) for row in order] for key in keys},
            n_errors=n_errors, first_error=first_error, n_timeouts=n_timeouts, n_untried=n_untried,
            preds=[merged[row][2] for row in order])
