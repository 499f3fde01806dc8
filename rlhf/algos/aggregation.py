"""Layout-invariant aggregation of a per-token loss matrix into a scalar.

A PPO mini-batch is split over data-parallel ranks and, on each rank, into micro-batches.
Every part computes its loss with the *global* normalisers of the mini-batch (``AggNorm``)
and the parts are summed (gradient accumulation + gradient all-reduce SUM).  Because every
mode below is a sum of per-sequence terms divided by a global constant, the summed loss and
its gradient are identical to the single-process, single-micro-batch loss::

    agg_loss(full, mask, mode) == sum_k agg_loss(part_k, mask_k, mode, AggNorm.from_masks(mask))

Modes (verl's ``actor.loss_agg_mode`` names), with ``l`` the loss, ``m`` the mask,
``N_tok = sum_{i,t} m_it``, ``N_seq`` = number of sequences with at least one token,
``L_max`` = configured response horizon:

* ``token-mean``              ``sum_{i,t} l_it m_it / N_tok``                      (DAPO eq. 8)
* ``seq-mean-token-sum``      ``sum_i (sum_t l_it m_it) / N_seq``
* ``seq-mean-token-mean``     ``sum_i (sum_t l_it m_it / |y_i|) / N_seq``           (GRPO eq. 3)
* ``seq-mean-token-sum-norm`` ``sum_i (sum_t l_it m_it / L_max) / N_seq``           (Dr.GRPO)
* ``token-sum``               ``sum_{i,t} l_it m_it``  (no normaliser; verl's ``token-sum``, the
  reduction of Tinker-style losses: the loss grows with the batch, so the learning rate must
  be set for the batch size)

Dr.GRPO choice: the Dr.GRPO paper (Liu et al. 2025, listing 1) replaces the per-response
``1/|o_i|`` by a constant ``1/MAX_TOKENS`` and keeps the mean over responses, i.e.
``sum / (N_seq * L_max)``.  Current verl main does the same (``seq_losses / loss_scale_factor``
then the seq-mean); older verl releases divided only by ``L_max`` (a loss ``N_seq`` times larger,
which the learning rate would have to absorb).  We follow the paper and current verl.

Sequences with no valid token (padding rows added by micro-batching) are not counted in
``N_seq``, so padding never changes the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf.algos.masked import masked_sum

__all__ = ["AggNorm", "agg_loss", "LOSS_AGG_MODES"]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "token-sum",
)


@dataclass(frozen=True)
class AggNorm:
    """Global normalisers of one mini-batch (counted over all micro-batches and all dp ranks).

    Attributes:
        global_tokens: number of loss tokens ``sum(loss_mask)`` in the whole mini-batch.
        global_seqs: number of sequences with at least one loss token in the mini-batch.
        max_response_len: the configured response horizon ``L_max`` (constant across steps;
            only ``seq-mean-token-sum-norm`` uses it).
    """

    global_tokens: float
    global_seqs: float
    max_response_len: int

    @classmethod
    def from_masks(
        cls, masks: torch.Tensor | Sequence[torch.Tensor], max_response_len: int
    ) -> "AggNorm":
        """Count tokens and non-empty sequences over one ``[B, T]`` mask or a list of them.

        The list form takes the masks of all parts (they may have different ``T``).  In a
        distributed run, all-reduce (SUM) the two counts over dp ranks instead and build
        ``AggNorm(tokens, seqs, max_response_len)`` directly.
        """
        parts = [masks] if isinstance(masks, torch.Tensor) else list(masks)
        tokens = 0.0
        seqs = 0.0
        for m in parts:
            per_seq = m.reshape(m.shape[0], -1).float().sum(dim=-1)  # [B]
            tokens += float(per_seq.sum())
            seqs += float((per_seq > 0).sum())
        return cls(global_tokens=tokens, global_seqs=seqs, max_response_len=int(max_response_len))


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    norm: AggNorm | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat [B, T]`` over ``loss_mask [B, T]`` into a scalar.

    Args:
        loss_mat: per-token loss ``[B, T]``.
        loss_mask: 0/1 (or weight) mask ``[B, T]``.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (see module docstring for the formulas).
        norm: global normalisers; ``None`` uses this batch's own counts and ``L_max = T``
            (the single-process result).

    Returns:
        scalar loss; ``0`` (graph attached) when there is no loss token at all.
    """
    _check_mode(loss_agg_mode)
    # An empty normaliser only happens when every numerator is zero too; dividing by 1 then
    # returns 0 with the graph kept, and avoids a host sync on the count.
    if norm is None:
        n_tokens = loss_mask.sum()
        n_tokens = torch.where(n_tokens > 0, n_tokens, torch.ones_like(n_tokens))
        n_seqs = (loss_mask.sum(dim=-1) > 0).sum()
        n_seqs = torch.where(n_seqs > 0, n_seqs, torch.ones_like(n_seqs))
        max_len = int(loss_mask.shape[-1])
    else:
        n_tokens = norm.global_tokens if norm.global_tokens > 0 else 1.0
        n_seqs = norm.global_seqs if norm.global_seqs > 0 else 1.0
        max_len = norm.max_response_len

    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / n_tokens
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)

    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-mean":
        # Empty rows have a zero numerator; the clamp only avoids 0/0.
        seq_len = loss_mask.sum(dim=-1).to(seq_losses.dtype)
        seq_losses = seq_losses / torch.where(seq_len > 0, seq_len, torch.ones_like(seq_len))
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        if max_len <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs max_response_len > 0, got {max_len}")
        seq_losses = seq_losses / max_len
    return seq_losses.sum() / n_seqs
