"""``rollout.over_sample_rate`` on the training side: start more prompts, keep the first groups done.

verl's rule is that a rollout aborts its remaining requests once ``(1 - over_sample_rate)`` of
the requests it started have completed. Here a step starts ``T`` prompts, the fewest with
``int(T * (1 - rate)) >= need`` (``need``: ``data.train_batch_size``, or ``data.gen_batch_size``
per generation batch under ``algorithm.filter_groups``), so that the finished groups fill the
batch; each rollout replica aborts the rest of its chunk once its share of ``need`` groups is
done (``rlhf.rollout.abort``). Then :meth:`OverSampling.settle`:

* every rank learns which started prompts finished (one all-reduce of ``T`` flags over dp);
* the step uses the first ``need`` finished prompts in the data order; the others (aborted, or
  finished beyond ``need`` when several groups end at the same decode step) go back to the front
  of the order (:class:`rlhf.data.backlog.PromptBacklog`), so no prompt is lost and none is
  trained twice;
* the used rows are dealt to the dp ranks mini-batch-major like fresh prompts
  (``rlhf.train.regroup``), by the caller.

The started prompts are cut into contiguous chunks over the dp ranks (the engine gives each
rank its chunk's rows); the backlog is part of the data-loader state in checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.data.backlog import PromptBacklog, started_prompts
from rlhf.data.loader import PromptLoader
from rlhf.models.parallel import all_reduce_sum
from rlhf.rollout.engine import chunk_bounds
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import Config

__all__ = ["OverSampling", "over_sampling_for"]


class OverSampling:
    """Draws the started prompts of a generation batch and settles which of them the step uses."""

    def __init__(self, loader: PromptLoader, rate: float, need: int, dp_rank: int, dp: int, group=None) -> None:
        self.backlog = PromptBacklog(loader)
        self.rate, self.need = rate, need
        self.started = started_prompts(need, rate)
        self.dp_rank, self.dp, self.group = dp_rank, dp, group

    def draw(self) -> tuple[list[int], list[int]]:
        """``(started dataset indices [T], this dp rank's positions in them)``."""
        started = self.backlog.take(self.started)
        start, end = chunk_bounds(len(started), self.dp)[self.dp_rank]
        return started, list(range(start, end))

    def settle(self, batch: RolloutBatch, started: list[int], local_rows: list[int],
               n: int) -> tuple[RolloutBatch, list[int], dict[str, float]]:
        """Keep this rank's rows of the used prompts; give the unused ones back.

        Args:
            batch: this rank's rows of ``local_rows`` (``n`` each, in order), ``batch.aborted`` set by the sampler.
            started: the started dataset indices (same on every rank).
            local_rows: this rank's positions in ``started``.
            n: samples per prompt.

        Returns:
            ``(kept rows, used dataset indices in data order, metrics)``; collective over the dp group.
        """
        aborted = batch.aborted if batch.aborted is not None else torch.zeros(len(batch), dtype=torch.bool)
        done = torch.zeros(len(started), dtype=torch.float64, device=batch.index.device)
        if local_rows:  # a group is done when none of its rows is flagged (the sampler flags whole groups)
            mine = (~aborted.view(len(local_rows), n).to(done.device)).all(1)
            done[torch.tensor(local_rows, device=done.device)] = mine.double()
        if self.dp > 1:
            done = all_reduce_sum(done, self.group)
        finished = done.bool().tolist()
        used_pos = [p for p, ok in enumerate(finished) if ok][:self.need]
        used_set = set(used_pos)
        self.backlog.give_back([started[p] for p in range(len(started)) if p not in used_set])
        keep = [j * n + s for j, p in enumerate(local_rows) if p in used_set for s in range(n)]
        kept = batch.select(keep)
        kept.aborted = None
        metrics = {"rollout/over_sample_started": float(len(started)),
                   "rollout/over_sample_returned": float(len(started) - len(used_pos))}
        return kept, [started[p] for p in used_pos], metrics


def over_sampling_for(cfg: Config, loader: PromptLoader, dp_rank: int, dp: int, group=None) -> Optional[OverSampling]:
    """The colocated trainer's :class:`OverSampling` (None when ``rollout.over_sample_rate`` is 0)."""
    if cfg.rollout.over_sample_rate <= 0 or cfg.trainer.mode != "colocated":
        return None
    return OverSampling(loader, cfg.rollout.over_sample_rate, loader.batch_size, dp_rank, dp, group)
