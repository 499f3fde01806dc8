"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", sec. 4).

Entropy falls when high-probability tokens get positive advantages: the entropy change of a
step is proportional to ``Cov(log pi(y_t), A_t)`` over the batch (eq. 3).  Both losses act on
the few tokens with the largest centred product

    ``cov_t = (A_t - mean(A)) (l_t - mean(l))``            (eq. 6, means over the batch's tokens)

* ``clip_cov``: among tokens with ``clip_cov_lb < cov_t < clip_cov_ub`` (and not already
  clipped by PPO) pick ``max(1, int(clip_cov_ratio N))`` at random and drop them from the
  PPO-clip loss (their loss is set to 0, so no gradient) — eq. 8.
* ``kl_cov``: the ``max(1, int(kl_cov_ratio N))`` tokens with the largest ``cov_t`` get a
  KL penalty ``ppo_kl_coef |l_t - l_old|`` on top of the unclipped ``-A_t r_t`` — eq. 9.

Layout invariance.  verl computes the means, the top-k and the random choice over each
micro-batch, so its update depends on the micro-batch size.  Here the selection is a
``[B, T]`` 0/1 ``cov_select`` computed once per mini-batch over all its tokens on all ranks
(:func:`select_cov_tokens`, all-reduced means and an all-gathered top-n) and passed to the loss; the "random" choice uses a key that is a
fixed hash of the token's ``(old log-prob, advantage, position)``, so the same tokens are
chosen on any layout.  The selection then uses ``l_old`` (the log-probs at the start of the
update, equal to ``l`` at its first step) instead of the current ``l``.  Without
``cov_select`` the loss selects over the tensors it is given with the current ``l``
(verl's single-micro-batch numbers, except that the random draw is the hash).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algos.aggregation import AggNorm
from rlhf.algos.masked import masked_mean
from rlhf.algos.policy_loss import DEFAULT_PARAMS, PolicyLossParams, finish_pg_loss, register_policy_loss

COV_LOSSES = ("clip_cov", "kl_cov")

__all__ = [
    "token_covariance",
    "selection_key",
    "n_selected",
    "nth_largest",
    "select_clip_cov",
    "select_kl_cov",
    "select_cov_tokens",
    "COV_LOSSES",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
]


@torch.no_grad()
def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor,
                     adv_mean: torch.Tensor | float | None = None,
                     logp_mean: torch.Tensor | float | None = None) -> torch.Tensor:
    """``cov_t = (A_t - mean A)(l_t - mean l)`` ``[B, T]``; means over ``mask`` unless given (global)."""
    adv_mean = masked_mean(advantages, mask) if adv_mean is None else adv_mean
    logp_mean = masked_mean(log_prob, mask) if logp_mean is None else logp_mean
    return (advantages - adv_mean) * (log_prob.detach() - logp_mean)


@torch.no_grad()
def selection_key(old_log_prob: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Pseudo-random key in [0, 1) ``[B, T]``, a fixed function of each token's values and column.

    Stands in for verl's ``randperm``: the same token gets the same key whatever micro-batch
    or rank it lands in.  (Classic GLSL hash ``frac(sin(x) * 43758.5453)``, in float64.)
    """
    col = torch.arange(old_log_prob.shape[-1], device=old_log_prob.device, dtype=torch.float64)
    x = old_log_prob.double() * 12.9898 + advantages.double() * 78.233 + (col + 1.0) * 37.719
    return torch.frac(torch.sin(x).abs() * 43758.5453)


def n_selected(ratio: float, n_tokens: float) -> int:
    """verl's count ``max(1, int(ratio * N))``; ``ratio`` must be > 0."""
    if ratio <= 0:
        raise ValueError(f"covariance selection ratio must be > 0, got {ratio}")
    return max(1, int(ratio * n_tokens))


def nth_largest(values: torch.Tensor, n: int, group=None) -> torch.Tensor:
    """The ``n``-th largest entry of ``values`` over all ranks of ``group`` (this rank alone when
    None), as a float64 scalar; ``-inf`` when there are fewer than ``n`` finite entries. Each
    rank contributes its local top ``n`` (one all-gather of ``n`` numbers)."""
    flat = values.reshape(-1).double()
    top = torch.full((n,), float("-inf"), dtype=torch.float64, device=values.device)
    k = min(n, flat.numel())
    if k:
        top[:k] = torch.topk(flat, k).values
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(top) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, top, group=group)
        top = torch.cat(parts)
    return torch.topk(top, n).values[-1]


@torch.no_grad()
def select_kl_cov(cov: torch.Tensor, mask: torch.Tensor, *, ratio: float, n_tokens: float | None = None,
                  group=None) -> torch.Tensor:
    """0/1 ``[B, T]``: the ``n_selected(ratio, n_tokens)`` masked tokens of largest ``cov`` over the
    ranks of ``group`` (``n_tokens``: the token count over those ranks; default this mask's)."""
    valid = mask.bool()
    score = torch.where(valid, cov, torch.full_like(cov, float("-inf")))
    n = n_selected(ratio, float(mask.sum()) if n_tokens is None else n_tokens)
    threshold = nth_largest(score, n, group)
    return (valid & (score >= threshold) & torch.isfinite(score)).to(cov.dtype)


@torch.no_grad()
def clip_cov_candidates(cov: torch.Tensor, mask: torch.Tensor, lb: float, ub: float) -> torch.Tensor:
    return mask.bool() & (cov > lb) & (cov < ub)


@torch.no_grad()
def select_clip_cov(cov: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, *, lb: float, ub: float, ratio: float,
                    n_tokens: float | None = None, group=None) -> torch.Tensor:
    """0/1 ``[B, T]``: of the candidates (``lb < cov < ub``), the ``n_selected(ratio, n_tokens)``
    with the smallest ``key`` over the ranks of ``group`` (all of them when there are fewer)."""
    cand = clip_cov_candidates(cov, mask, lb, ub)
    score = torch.where(cand, -key.to(cov.dtype), torch.full_like(cov, float("-inf")))
    threshold = nth_largest(score, n_selected(ratio, float(mask.sum()) if n_tokens is None else n_tokens), group)
    if not torch.isfinite(threshold):  # fewer candidates than n: take them all
        threshold = torch.tensor(-2.0, dtype=torch.float64, device=cov.device)
    return (cand & (score >= threshold)).to(cov.dtype)


@torch.no_grad()
def select_cov_tokens(loss_mode: str, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      params: PolicyLossParams, sums: torch.Tensor, group=None) -> torch.Tensor:
    """``cov_select`` ``[B, R]`` of ``loss_mode`` for this rank's rows of a mini-batch whose other
    rows live on the ranks of ``group`` (the dp group). ``sums`` are
    :func:`rlhf.algos.entropy_tools.covariance_sums` of ``(old_log_prob, advantages, mask)``
    already summed over ``group``: they give the global means and token count."""
    _, s_a, s_l, n_tok = (float(x) for x in sums)
    adv_mean, logp_mean = s_a / max(n_tok, 1.0), s_l / max(n_tok, 1.0)
    cov = token_covariance(advantages.double(), old_log_prob.double(), mask, adv_mean, logp_mean)
    if loss_mode == "kl_cov":
        sel = select_kl_cov(cov, mask, ratio=params.kl_cov_ratio, n_tokens=n_tok, group=group)
    elif loss_mode == "clip_cov":
        sel = select_clip_cov(cov, selection_key(old_log_prob, advantages), mask, lb=params.clip_cov_lb,
                              ub=params.clip_cov_ub, ratio=params.clip_cov_ratio, n_tokens=n_tok, group=group)
    else:
        raise ValueError(f"select_cov_tokens: {loss_mode!r} is not one of {COV_LOSSES}")
    return sel.to(old_log_prob.dtype)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm: AggNorm | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_imp_ratio_cap: float = -1,
    rollout_is_weights: torch.Tensor | None = None,
    params: PolicyLossParams | None = None,
    cov_select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (eq. 8): ``L_t = max(-A_t r_t, -A_t clip(r_t, 1-eps_low, 1+eps_high)) (1 - s_t)``.

    ``s_t`` = 1 on the selected high-covariance tokens that PPO does not already clip
    (``actor.clip_cov_ratio`` 2e-4, ``actor.clip_cov_lb`` 1.0, ``actor.clip_cov_ub`` 5.0; verl
    ``actor.policy_loss.clip_cov_*``).  No dual clip and no log-ratio clamp, as verl.
    Metrics: ``pg_clipfrac`` (share of tokens with ``s_t = 1``, verl's), ``ppo_kl``,
    ``cov_selected_frac``.
    """
    p = params or DEFAULT_PARAMS
    neg_kl = log_prob - old_log_prob
    ratio = torch.exp(neg_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    with torch.no_grad():
        clip_by_origin = (pg_losses2 > pg_losses1) & response_mask.bool()
        if cov_select is None:
            cov = token_covariance(advantages, log_prob, response_mask)
            cov = torch.where(clip_by_origin, torch.full_like(cov, float("-inf")), cov)
            cov_select = select_clip_cov(cov, selection_key(old_log_prob, advantages), response_mask,
                                         lb=p.clip_cov_lb, ub=p.clip_cov_ub, ratio=p.clip_cov_ratio)
        drop = cov_select.bool() & ~clip_by_origin & response_mask.bool()
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * (~drop).to(pg_losses1.dtype)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean(drop.float(), response_mask),
                   "ppo_kl": masked_mean(-neg_kl, response_mask),
                   "cov_selected_frac": masked_mean(drop.float(), response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm: AggNorm | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_imp_ratio_cap: float = -1,
    rollout_is_weights: torch.Tensor | None = None,
    params: PolicyLossParams | None = None,
    cov_select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (eq. 9): ``L_t = -A_t r_t + ppo_kl_coef |l_t - l_old| s_t``, no clipping.

    ``s_t`` = 1 on the ``max(1, int(kl_cov_ratio N))`` tokens of largest covariance
    (``actor.kl_cov_ratio`` 2e-4, ``actor.ppo_kl_coef`` 1.0; verl ``actor.policy_loss.*``).
    Clip settings are unused.  Metrics: ``ppo_kl`` (mean ``|l - l_old|``, as verl),
    ``pg_clipfrac`` (0), ``cov_selected_frac``.
    """
    p = params or DEFAULT_PARAMS
    neg_kl = log_prob - old_log_prob
    abs_kl = neg_kl.abs()
    ratio = torch.exp(neg_kl)
    if cov_select is None:
        cov = token_covariance(advantages, log_prob, response_mask)
        cov_select = select_kl_cov(cov, response_mask, ratio=p.kl_cov_ratio)
    sel = cov_select.to(ratio.dtype) * response_mask
    pg_losses = -advantages * ratio + p.ppo_kl_coef * abs_kl * sel
    with torch.no_grad():
        metrics = {"pg_clipfrac": torch.zeros((), device=pg_losses.device),
                   "ppo_kl": masked_mean(abs_kl, response_mask),
                   "cov_selected_frac": masked_mean(sel, response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)
