"""Rows without a gradient in the PPO update: no backward for them, and the same step and metrics.

A GRPO group whose n samples all got the same reward has advantage 0 on every token (on the
quickstart that is half of the rows at the start and most of them once it solves the task). For
the policy losses in :data:`GRAD_FREE_LOSSES` every token's loss is ``A_t`` times a finite factor,
so such a row's loss and gradient are exactly 0; with no entropy bonus, no KL loss and no MoE aux
loss the row adds nothing to the mini-batch's gradient. The update then runs its forward and
backward over the other rows only. The loss is still normalised by the mini-batch's global token
and sequence counts over *all* rows (:class:`rlhf.algos.aggregation.AggNorm`), so the optimizer
step is the same up to fp32 rounding (the remaining rows are packed into other micro-batches; adding
exact zeros never changed a sum). verl has no such switch; its updates run every row.

The logged metrics stay those of every row: the grad-free rows' loss terms (``ppo_kl``, clip
fractions) are evaluated from their log-probs under the current weights without a graph. On the first
mini-batch of the first epoch, when the old log-probs are the actor's own at these weights, those
*are* the old log-probs (verl's on-policy rule, ``old_log_prob = log_prob.detach()``) and nothing is
computed for them; on later mini-batches a forward-only pass (no backward) computes them.

A row is grad-free when ``advantages * response_mask`` is exactly 0 on all its tokens (a row with no
loss token too); a NaN advantage keeps the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlhf.models.parallel import all_reduce_sum

# Losses whose per-token value is A_t x (a finite function of the ratio / log-prob): zero gradient at A = 0.
# Not dro (quadratic proximal term), kl_cov (|log ratio| penalty), clip_cov (covariance-selected tokens),
# bypass_mode (rollout-correction variants).
GRAD_FREE_LOSSES = frozenset({"vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"})


def skips_grad_free_rows(actor_cfg, entropy_coeff: float, *, moe: bool, pipeline: bool) -> bool:
    """Whether this update may skip the backward of zero-advantage rows (``actor.skip_zero_advantage_rows``).

    Off when another loss term gives those rows a gradient (entropy bonus at this step, KL loss), for
    the losses outside :data:`GRAD_FREE_LOSSES`, for MoE actors (routing replay and expert-load metrics
    follow every row's tokens) and under pp (one pipelined pass over the mini-batch's rows).
    """
    return (bool(getattr(actor_cfg, "skip_zero_advantage_rows", False)) and actor_cfg.policy_loss in GRAD_FREE_LOSSES
            and entropy_coeff == 0 and not actor_cfg.use_kl_loss and not moe and not pipeline)


def grad_free_rows(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: rows whose advantage is exactly 0 on every loss token. ``advantages, response_mask [N, R]``."""
    return ((advantages * response_mask) == 0).all(dim=-1)


@dataclass
class RowSplit:
    """One mini-batch's local rows split by :func:`grad_free_rows`, with the dp-wide maxima that fix
    how many micro-batches every rank runs (FSDP's collectives need the same count on every rank)."""

    kept: torch.Tensor  # [k] local row indices with a gradient
    free: torch.Tensor  # [f] local row indices without one
    kept_max: int       # max over dp ranks of len(kept)
    free_max: int       # max over dp ranks of len(free)


def count_vectors(free_masks: list[torch.Tensor], group: Optional[dist.ProcessGroup],
                  device: torch.device) -> torch.Tensor:
    """``[M, 2 * dp]`` float64: this rank's (kept, free) row counts per mini-batch in its own slot, zeros
    elsewhere, so that a SUM all-reduce yields every rank's counts (one collective with the others)."""
    dp = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    out = torch.zeros(len(free_masks), 2 * dp, dtype=torch.float64, device=device)
    for i, free in enumerate(free_masks):
        nf = free.to(device).sum().double()
        out[i, 2 * rank + 1] = nf
        out[i, 2 * rank] = free.numel() - nf
    return out


def plan_splits(free_masks: list[torch.Tensor], reduced_counts: list[list[float]],
                local_flags: list[float]) -> list[RowSplit]:
    """RowSplits from the host copies of the all-reduced :func:`count_vectors` rows and this rank's
    concatenated grad-free flags (the same mini-batch order)."""
    splits, at = [], 0
    for free, counts in zip(free_masks, reduced_counts):
        flags = local_flags[at:at + free.numel()]
        at += free.numel()
        kept = [i for i, f in enumerate(flags) if not f]
        freed = [i for i, f in enumerate(flags) if f]
        splits.append(RowSplit(kept=torch.tensor(kept, dtype=torch.long), free=torch.tensor(freed, dtype=torch.long),
                               kept_max=int(max(counts[0::2], default=0)), free_max=int(max(counts[1::2], default=0))))
    return splits


def reduce_with_splits(base_counts: torch.Tensor, free_masks: list[torch.Tensor], group,
                       device: torch.device) -> tuple[list[list[float]], list[RowSplit]]:
    """The update's one all-reduce and host read per epoch, extended by the row splits: ``base_counts
    [M, c]`` (summed over ``group``) and this rank's grad-free flags -> (base rows, RowSplits)."""
    c = base_counts.shape[1]
    full = all_reduce_sum(torch.cat([base_counts.to(device), count_vectors(free_masks, group, device)], 1), group)
    flags = torch.cat([m.to(device).double() for m in free_masks]) if free_masks else full.new_zeros(0)
    host = torch.cat([full.flatten(), flags]).tolist()
    width = full.shape[1]
    rows = [host[i * width:(i + 1) * width] for i in range(len(free_masks))]
    return [r[:c] for r in rows], plan_splits(free_masks, [r[c:] for r in rows], host[len(rows) * width:])


def agreed_chunks(n_rows: int, size: int, max_rows: int) -> list[torch.Tensor]:
    """Row chunks of at most ``size``, as many as the rank with ``max_rows`` rows needs (and at least one):
    ranks with fewer rows get empty chunks, which run a zero-weight pass to keep FSDP in step."""
    count = max(1, math.ceil(max_rows / size))
    chunks = [torch.arange(s, min(s + size, n_rows)) for s in range(0, n_rows, size)]
    return chunks + [torch.arange(0)] * (count - len(chunks))


def split_mini_step(worker, mini, split: RowSplit, terms: dict, temperature: float, metrics, *,
                    on_policy: bool) -> torch.Tensor:
    """The actor's mini-batch step (``PolicyWorker._mini_step``) with the rows of ``split.free`` left out
    of the backward; their loss terms still enter the loss sum and the metrics. Returns the loss sum."""
    cfg = worker.actor_cfg
    # First: a no-grad forward leaves a whole-model FSDP unit gathered (keep_unsharded); the backward
    # below reshards it before the optimizer step changes the shards.
    step_loss = grad_free_terms(worker, mini.select(split.free), split.free_max, on_policy, terms, temperature,
                                metrics, mini)
    kept = mini.select(split.kept)
    micro_list = worker._micro_batches(kept, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu) \
        if cfg.use_dynamic_bsz else agreed_chunks(len(kept), cfg.ppo_micro_batch_size_per_gpu, split.kept_max)
    return step_loss + worker._grad_pass(kept, micro_list, terms, temperature, metrics, mini)


@torch.no_grad()
def grad_free_terms(worker, free, free_max: int, on_policy: bool, terms: dict, temperature: float, metrics,
                    dummy) -> torch.Tensor:
    """Loss sum (exactly 0 unless a value is NaN / inf) and metrics of rows without a gradient, from their
    log-probs at the current weights: the old ones when ``on_policy``, else a forward-only pass in
    log-prob micro-batches (the same count on every dp rank; ``dummy``'s first row fills the gaps)."""
    cfg = worker.actor_cfg
    step_loss = torch.zeros((), dtype=torch.float64, device=worker.device)
    if free_max == 0:
        return step_loss
    if on_policy:
        chunks = [torch.arange(len(free))] if len(free) else []
    elif cfg.use_dynamic_bsz:
        chunks = worker._micro_batches(free, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_max_token_len_per_gpu)
    else:
        chunks = agreed_chunks(len(free), cfg.log_prob_micro_batch_size_per_gpu, free_max)
    for rows in chunks:
        if len(rows) == 0:
            worker.forward_log_probs(dummy.input_ids[:1], dummy.attention_mask[:1],
                                     response_length=dummy.response_length, temperature=temperature)
            continue
        mb = free.select(rows)
        log_probs = mb.old_log_probs if on_policy else worker.forward_log_probs(
            mb.input_ids, mb.attention_mask, response_length=mb.response_length, temperature=temperature,
            multi_modal=mb.multi_modal)[0]
        loss, parts = worker._loss(log_probs, None, mb.response_mask, mb.old_log_probs, mb.advantages,
                                   mb.rollout_log_probs, mb.ref_log_probs, cov_select=mb.cov_select,
                                   is_weights=mb.rollout_is_weights, **terms)
        step_loss += loss.double()
        w = mb.response_mask.sum()
        for name, value in parts.items():
            metrics.add(name, value, w)
    return step_loss
