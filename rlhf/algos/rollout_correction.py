"""Rollout-correction "bypass" mode (verl ``actor.policy_loss.loss_mode: bypass_mode``).

In bypass mode the sampler's log-probs ``l_roll`` play the role of the old policy: the
trust region and the importance weights are taken against the policy that really
generated the data (the rollout engine, possibly another precision or kernel), not
against a recomputation in the training layout.  verl's docs/algo/rollout_corr.md;
Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL training").

Two loss types (``actor.rollout_correction_loss_type``; verl
``algorithm.rollout_correction.loss_type``):

* ``ppo_clip`` (default): ``vanilla`` PPO-clip with ``old = l_roll``.  The ratio
  ``pi_theta / pi_roll`` already is the importance weight, so no extra weight is applied.
* ``reinforce``: ``L_t = -w_t A_t l_t`` with the truncated importance weight
  ``w = min(pi_theta / pi_roll, rollout_is_threshold)`` (detached) per token
  (``actor.rollout_is: token``) or per sequence (``sequence``: ``exp(sum_t (l_t - l_roll))``
  truncated, broadcast over the row); ``rollout_is: ""`` gives plain REINFORCE.

Rejection sampling, the token veto and batch-normalised weights are decoupled-mode corrections
here (rlhf/algos/rollout_corr.py); bypass mode refuses them (verl tests them against the current
policy inside the loss).  ``rollout_is_weights`` is ignored in bypass mode.
``old_log_prob`` (the training-layout recomputation) is unused here; ``tis_imp_ratio_cap``
is ignored (bypass replaces TIS).
"""

from __future__ import annotations

import torch

from rlhf.algos.aggregation import AggNorm, agg_loss
from rlhf.algos.masked import masked_mean, masked_sum
from rlhf.algos.policy_loss import DEFAULT_PARAMS, PolicyLossParams, compute_policy_loss_vanilla, register_policy_loss

__all__ = ["ROLLOUT_IS_LEVELS", "BYPASS_LOSS_TYPES", "bypass_is_weights", "rollout_is_weights", "compute_policy_loss_bypass_mode"]

ROLLOUT_IS_LEVELS = ("token", "sequence", "")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@torch.no_grad()
def bypass_is_weights(log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       level: str, threshold: float) -> torch.Tensor | None:
    """Truncated IS weights ``[B, T]`` (``None`` for ``level == ""``); see module docstring."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"actor.rollout_is must be one of {ROLLOUT_IS_LEVELS}, got {level!r}")
    if not level:
        return None
    log_w = torch.clamp(log_prob.detach() - rollout_log_probs, min=-20.0, max=20.0)
    if level == "sequence":
        log_w = torch.clamp(masked_sum(log_w, mask, dim=-1), min=-20.0, max=20.0).unsqueeze(-1).expand_as(log_prob)
    return torch.exp(log_w).clamp(max=threshold)


rollout_is_weights = bypass_is_weights  # the earlier name (the loss's keyword of that name shadows it there)


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
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
    """Bypass mode (see module docstring).  Metrics: the chosen loss's, ``ppo_kl`` against the
    rollout policy, and ``rollout_is_mean`` (mean IS weight; 1 when ``rollout_is`` is off)."""
    p = params or DEFAULT_PARAMS
    if rollout_log_probs is None:
        raise ValueError("policy loss 'bypass_mode' needs the sampler's rollout_log_probs")
    if p.loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"actor.rollout_correction_loss_type must be one of {BYPASS_LOSS_TYPES}, got {p.loss_type!r}")
    weights = bypass_is_weights(log_prob, rollout_log_probs, response_mask, p.rollout_is, p.rollout_is_threshold)
    if p.loss_type == "ppo_clip":
        loss, metrics = compute_policy_loss_vanilla(
            rollout_log_probs, log_prob, advantages, response_mask, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode, norm=norm)
    else:
        pg_losses = -advantages * log_prob
        if weights is not None:
            pg_losses = pg_losses * weights
        loss = agg_loss(pg_losses, response_mask, loss_agg_mode, norm)
        with torch.no_grad():
            metrics = {"pg_clipfrac": torch.zeros((), device=loss.device),
                       "ppo_kl": masked_mean(rollout_log_probs - log_prob, response_mask)}
    with torch.no_grad():
        metrics["rollout_is_mean"] = (masked_mean(weights, response_mask) if weights is not None
                                      else torch.ones((), device=loss.device))
    return loss, {k: v.detach() for k, v in metrics.items()}
