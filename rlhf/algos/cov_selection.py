"""Global token selection of Clip-Cov / KL-Cov over a whole mini-batch, on every layout.

verl selects the high-covariance tokens within each micro-batch, so its update changes with
the micro-batch size and the number of ranks. Here the selection is made once per
mini-batch over all of its tokens on all dp ranks, from quantities fixed for the mini-batch
(the old log-probs, which equal the current ones at its first step, and the advantages):

* the means of ``A`` and ``l_old`` are global (two all-reduced sums);
* the threshold is the global ``n``-th largest score, from an all-gather of each rank's
  local top ``n`` (``n = max(1, int(ratio * N_tokens))``, N over all ranks, as verl);
* Clip-Cov's "random" choice among candidates is the ``n`` smallest hash keys
  (``selection_key``), so it does not depend on which rank or micro-batch holds a token.

The result is a ``[B, R]`` 0/1 tensor passed to the loss as ``cov_select``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algos.policy_loss import PolicyLossParams
from rlhf.algos.policy_loss_cov import (
    clip_cov_candidates,
    n_selected,
    select_clip_cov,
    select_kl_cov,
    selection_key,
    token_covariance,
)

COV_LOSSES = ("clip_cov", "kl_cov")


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _global_nth_largest(score: torch.Tensor, n: int, group) -> torch.Tensor:
    """The n-th largest entry of ``score`` over all ranks of ``group`` (-inf if fewer finite)."""
    flat = score.reshape(-1)
    top = torch.full((n,), float("-inf"), dtype=torch.float64, device=score.device)
    k = min(n, flat.numel())
    if k:
        top[:k] = torch.topk(flat.double(), k).values
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(top) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, top, group=group)
        top = torch.cat(parts)
    return torch.topk(top, n).values[-1]


@torch.no_grad()
def global_cov_select(loss_mode: str, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      params: PolicyLossParams, group=None) -> torch.Tensor:
    """``[B, R]`` selection for ``loss_mode`` (clip_cov or kl_cov) over this rank's rows of a
    mini-batch whose other rows live on the ranks of ``group`` (the dp group)."""
    if loss_mode not in COV_LOSSES:
        raise ValueError(f"global_cov_select: {loss_mode!r} is not one of {COV_LOSSES}")
    m = mask.to(torch.float64)
    sums = torch.stack([(advantages.double() * m).sum(), (old_log_prob.double() * m).sum(), m.sum()])
    _sum(sums, group)
    n_tok = float(sums[2])
    adv_mean, logp_mean = sums[0] / max(n_tok, 1.0), sums[1] / max(n_tok, 1.0)
    cov = token_covariance(advantages.double(), old_log_prob.double(), mask, adv_mean, logp_mean)
    valid = mask.bool()
    if loss_mode == "kl_cov":
        n = n_selected(params.kl_cov_ratio, n_tok)
        score = torch.where(valid, cov, torch.full_like(cov, float("-inf")))
        return select_kl_cov(cov, mask, _global_nth_largest(score, n, group)).to(old_log_prob.dtype)
    n = n_selected(params.clip_cov_ratio, n_tok)
    key = selection_key(old_log_prob, advantages)
    cand = clip_cov_candidates(cov, mask, params.clip_cov_lb, params.clip_cov_ub)
    score = torch.where(cand, -key, torch.full_like(key, float("-inf")))
    threshold = _global_nth_largest(score, n, group)
    if not torch.isfinite(threshold):  # fewer candidates than n over all ranks: take them all
        threshold = torch.tensor(-2.0, dtype=torch.float64, device=cov.device)
    return select_clip_cov(cov, key, mask, lb=params.clip_cov_lb, ub=params.clip_cov_ub,
                           threshold=threshold).to(old_log_prob.dtype)
