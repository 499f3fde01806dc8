"""Policy losses beyond PPO-clip: gpg, cispo, dro, dppo_tv, dppo_kl, sapo, geo_mean (GMPO).

Same uniform signature as rlhf/algos/policy_loss.py (``PolicyLossFn``); all tensors are
``[B, T]``, the loss is aggregated with ``agg_loss`` over ``loss_agg_mode`` and the
mini-batch ``norm`` (so micro-batch / rank losses sum to the full-batch loss), and with
``tis_imp_ratio_cap > 0`` every per-token loss is multiplied by the truncated
sampler-to-trainer weight, as for ``vanilla``.  Names, defaults and numbers follow verl's
``core_algos`` (``actor.policy_loss.loss_mode``); differences are stated per loss.

Notation: ``l_t = log pi_theta(y_t)``, ``l_old = log pi_old(y_t)``, ``r_t = exp(l_t - l_old)``
(log-ratio clamped to [-20, 20] where verl clamps), ``sg`` = stop-gradient, ``A_t`` advantage.
"""

from __future__ import annotations

import torch

from rlhf.algos.aggregation import AggNorm, agg_loss
from rlhf.algos.masked import masked_mean, masked_sum
from rlhf.algos.policy_loss import (
    DEFAULT_PARAMS,
    PolicyLossParams,
    _tis_weight,
    clamped_log_ratio,
    finish_pg_loss,
    register_policy_loss,
)

__all__ = [
    "compute_policy_loss_gpg",
    "compute_policy_loss_cispo",
    "compute_policy_loss_dro",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_sapo",
    "compute_policy_loss_geo_mean",
]


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
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
    """Group Policy Gradient (Chu et al. 2025, "GPG", eq. 5): plain REINFORCE, no ratio, no clip.

    ``L_t = -A_t l_t``; pair it with ``algorithm.adv_estimator: gpg``.  Clip settings are
    unused.  Metrics: ``pg_clipfrac`` (0), ``ppo_kl``.
    """
    pg_losses = -advantages * log_prob
    with torch.no_grad():
        metrics = {"pg_clipfrac": torch.zeros(()),
                   "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
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
    """CISPO (MiniMax-M1, 2025, eq. 4): clip the importance weight, not the update.

    ``L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t l_t``: every token keeps a gradient
    ``-w_t A_t grad l_t`` with a bounded weight (PPO drops clipped tokens' gradients).
    ``eps_low/high`` are ``actor.clip_ratio_low/high`` (MiniMax uses a large eps_high).
    Metrics: ``pg_clipfrac`` (share of tokens whose weight was clipped), ``ppo_kl``.
    """
    neg_kl = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = -clipped.detach() * advantages * log_prob
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean((ratio != clipped).float(), response_mask),
                   "ppo_kl": masked_mean(-neg_kl, response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


@register_policy_loss("dro")
def compute_policy_loss_dro(
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
    """Direct Reward Optimization (Richemond et al. 2024, eq. 7; verl ``docs/algo/dro.md``).

    A quadratic proximal penalty replaces the clip:
    ``L_t = -(A_t l_t - beta/2 (l_t - l_old)^2)`` with ``beta = actor.dro_beta``
    (verl ``actor.policy_loss.dro_beta``), which has no default and must be > 0.
    Metrics: ``pg_clipfrac`` (0), ``ppo_kl``.
    """
    beta = (params or DEFAULT_PARAMS).dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"policy loss 'dro' needs actor.dro_beta > 0 (verl: actor.policy_loss.dro_beta), got {beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(advantages * log_prob - 0.5 * beta * log_ratio.square())
    with torch.no_grad():
        metrics = {"pg_clipfrac": torch.zeros(()), "ppo_kl": masked_mean(-log_ratio, response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


def _dppo(valid: torch.Tensor, ratio, neg_kl, log_prob, old_log_prob, advantages, response_mask, clip_ratio_c,
          loss_agg_mode, norm, rollout_log_probs, tis_imp_ratio_cap, rollout_is_weights):
    valid = valid.detach().float()
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    pg_losses = -advantages * truncated * log_prob * valid
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean(1.0 - valid, response_mask),
                   "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).float() * valid, response_mask),
                   "ppo_kl": masked_mean(-neg_kl, response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


_DPPO_DOC = """
    Both DPPO variants (Divergence PPO, arXiv 2602.04879; verl ``docs/algo/dppo.md``) replace
    the ratio clip with a trust region on the *token probabilities* ``p = exp(l)``:
    ``L_t = -A_t sg(min(r_t, c)) l_t v_t`` (the gradient is the truncated-IS policy gradient
    ``-A_t min(r_t, c) grad l_t`` on valid tokens) with ``c = actor.clip_ratio_c`` and the 0/1
    validity ``v_t`` below.  ``actor.clip_ratio_low/high`` are divergence thresholds here, not
    ratio bounds.  Metrics: ``pg_clipfrac`` (share of masked tokens), ``pg_clipfrac_lower``
    (valid tokens whose ratio was truncated at ``c``), ``ppo_kl``.
"""


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
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
    """DPPO-Binary-TV: ``v_t = [p - p_old <= eps_high]`` if ``A_t > 0`` else ``[p - p_old >= -eps_low]``."""
    neg_kl = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    delta = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, delta <= clip_ratio_high, delta >= -clip_ratio_low)
    return _dppo(valid, ratio, neg_kl, log_prob, old_log_prob, advantages, response_mask, clip_ratio_c,
                 loss_agg_mode, norm, rollout_log_probs, tis_imp_ratio_cap, rollout_is_weights)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
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
    """DPPO-Binary-KL: binary KL ``D = p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p))``;
    ``v_t = [D <= eps_high or p <= p_old]`` if ``A_t > 0`` else ``[D <= eps_low or p >= p_old]``
    (a token moving *against* its advantage is never masked)."""
    neg_kl = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                        (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(valid, ratio, neg_kl, log_prob, old_log_prob, advantages, response_mask, clip_ratio_c,
                 loss_agg_mode, norm, rollout_log_probs, tis_imp_ratio_cap, rollout_is_weights)


compute_policy_loss_dppo_tv.__doc__ += _DPPO_DOC
compute_policy_loss_dppo_kl.__doc__ += _DPPO_DOC


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    norm: AggNorm | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_imp_ratio_cap: float = -1,
    rollout_is_weights: torch.Tensor | None = None,
    params: PolicyLossParams | None = None,
    cov_select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv 2511.20347, eq. 6-8).

    A sigmoid gate replaces the hard clip: ``f(r; tau) = 4/tau sigmoid(tau (r - 1))``,
    ``L_t = -f(r_t; tau_t) A_t`` with ``tau_t = tau_pos`` if ``A_t > 0`` else ``tau_neg``
    (``actor.tau_pos`` / ``actor.tau_neg``, verl defaults 1.0 / 1.05).  At ``r = 1`` the gate's
    slope is 1, so on-policy the gradient is the policy gradient; it decays smoothly off-policy.

    verl always aggregates SAPO with ``seq-mean-token-mean`` (the default here); like ``gspo``
    we honour ``actor.loss_agg_mode`` so set it to ``seq-mean-token-mean`` for verl's numbers.
    Clip settings are unused.  Metrics: ``pg_clipfrac`` (0), ``ppo_kl``.
    """
    p = params or DEFAULT_PARAMS
    neg_kl = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    tau = torch.where(advantages > 0, torch.full_like(advantages, p.tau_pos), torch.full_like(advantages, p.tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    with torch.no_grad():
        metrics = {"pg_clipfrac": torch.zeros(()), "ppo_kl": masked_mean(-neg_kl, response_mask)}
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    norm: AggNorm | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_imp_ratio_cap: float = -1,
    rollout_is_weights: torch.Tensor | None = None,
    params: PolicyLossParams | None = None,
    cov_select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, arXiv 2507.20673, eq. 4).

    Token log-ratios ``d_t = l_t - l_old`` are clipped in log space with the sign of the
    advantage (``clip(d, -eps_low, eps_high)``, the pessimistic side kept), the sequence ratio
    is their geometric mean ``R_i = exp(1/|y_i| sum_t d~_t)`` and
    ``L_i = -Abar_i R_i`` with ``Abar_i`` the token-mean advantage (sequence-level advantages).
    Every token of row ``i`` carries ``L_i`` so ``seq-mean-token-mean`` (default) gives verl's
    ``mean_i L_i`` over non-empty rows (verl also counts empty rows; they add 0 loss).  Other
    modes weight rows by length.  ``eps`` are in log space (GMPO uses e.g. 0.4).
    Metrics: ``pg_clipfrac`` (clipped tokens with A > 0), ``pg_clipfrac_lower`` (A < 0), ``ppo_kl``.
    """
    neg_kl = log_prob - old_log_prob  # verl leaves this unclamped
    sgn = torch.sign(advantages)
    neg_kl_clamp = torch.clamp(neg_kl, -clip_ratio_low, clip_ratio_high)
    neg_kl_min = sgn * torch.minimum(sgn * neg_kl, sgn * neg_kl_clamp)
    length = response_mask.sum(dim=-1)
    seq_ratio = torch.exp(masked_sum(neg_kl_min, response_mask, dim=-1) / (length + 1e-8))  # [B]
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / (length + 1e-8)  # [B]
    seq_loss = -seq_adv * seq_ratio
    tis = _tis_weight(old_log_prob, rollout_log_probs, tis_imp_ratio_cap)
    metrics = {}
    if tis is not None:  # token weights -> one weight per sequence (geometric mean), as verl
        seq_w = torch.exp(masked_sum(torch.log(tis + 1e-10), response_mask, dim=-1) / (length + 1e-8))
        seq_loss = seq_loss * seq_w
        metrics["tis_imp_ratio_mean"] = masked_mean(tis, response_mask)
    if rollout_is_weights is not None:  # likewise for the rollout-correction weights
        seq_loss = seq_loss * torch.exp(
            masked_sum(torch.log(rollout_is_weights + 1e-10), response_mask, dim=-1) / (length + 1e-8))
    pg_losses = seq_loss.unsqueeze(-1).expand_as(advantages)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, norm)
    with torch.no_grad():
        clipped = torch.ne(neg_kl, neg_kl_clamp).float()
        metrics.update({"pg_clipfrac": masked_mean(clipped * (advantages > 0), response_mask),
                        "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), response_mask),
                        "ppo_kl": masked_mean(-neg_kl, response_mask)})
    return loss, {k: v.detach() for k, v in metrics.items()}
