"""``rollout.over_sample_rate`` on the training side: start more prompts, keep the first groups done.

verl's rule is that a rollout aborts its remaining requests once ``(1 - over_sample_rate)`` of
the requests it started have completed. Here a step starts ``T`` prompts, the fewest with
``int(T * (1 - rate)) >= need`` (``need``: ``data.train_batch_size``, or ``data.gen_batch_size``
per generation batch under ``algorithm.filter_groups``), so that the finished groups fill the
batch; the rollout replicas abort the rest once ``need`` groups have finished over all of them
(``rlhf.rollout.abort``). Then :meth:`OverSampling.settle`:

* every rank learns which started prompts finished (one all-reduce of ``T`` flags over dp);
* the step uses the first ``need`` finished prompts in the data order; the others (aborted, or
  finished beyond ``need`` when several groups end at the same decode step) go back to the front
  of the order (:class:`rlhf.data.backlog.PromptBacklog`), so no prompt is lost and none is
  trained twice;
* the caller deals the used rows to the dp ranks mini-batch-major like fresh prompts
  (``rlhf.train.regroup``) before they are scored.

The started prompts are cut into contiguous chunks over the dp ranks (the engine gives each
rank its chunk's rows); the backlog is part of the data-loader state in checkpoints.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.data.backlog import PromptBacklog, started_prompts
from rlhf.data.loader import PromptLoader
from rlhf.models.parallel import all_reduce_sum
from rlhf.rollout.engine import chunk_bounds, decode_responses
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import Config

__all__ = ["OverSampling", "over_sampling_for", "with_row_lists"]


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


def over_sampling_for(cfg: Config, loader: PromptLoader, dp_rank: int, dp: int, group=None, *,
                      generates: bool = True) -> tuple[PromptLoader | PromptBacklog, Optional[OverSampling]]:
    """``(the data order, the OverSampling that draws from it)`` of a trainer or a one_step_off rollout rank.

    Without ``rollout.over_sample_rate``, and under fully_async (its stream refills a slot as soon as a
    group ends and carries unfinished groups over weight syncs: it never waits for a tail), the loader
    and None. ``generates`` False (one_step_off's training side): the backlog alone, mirrored from the
    rollout role's messages (``rlhf.train.async_rl.pipeline``).
    """
    if cfg.rollout.over_sample_rate <= 0 or cfg.trainer.mode == "fully_async":
        return loader, None
    if not generates:
        return PromptBacklog(loader), None
    over = OverSampling(loader, cfg.rollout.over_sample_rate, loader.batch_size, dp_rank, dp, group)
    return over.backlog, over


def with_row_lists(out: RolloutBatch, examples, tokenizer) -> RolloutBatch:
    """Rows moved by ``rlhf.train.regroup.regroup_rows`` (tensors only) with their per-row lists rebuilt
    from the dataset (the group id is the dataset index) and the response texts decoded again."""
    ex = [examples[k] for k in out.index.tolist()]
    out.ground_truths = [e.ground_truth for e in ex]
    out.data_sources = [e.data_source for e in ex]
    out.extra_infos = [e.extra_info for e in ex]
    # a VLM's images: from the dataset too (a prompt's pixel_values never travel between ranks)
    out.multi_modal = [e.multi_modal for e in ex] if any(e.multi_modal is not None for e in ex) else []
    out.response_texts = decode_responses(tokenizer, out.responses, out.attention_mask[:, -out.responses.shape[1]:])
    return out
