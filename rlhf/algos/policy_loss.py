"""Policy-gradient losses, chosen by name (verl's ``actor.policy_loss.loss_mode`` values).

Uniform signature (``PolicyLossFn``)::

    loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask, *,
                       clip_ratio_low, clip_ratio_high, clip_ratio_c=3.0,
                       loss_agg_mode="token-mean", norm=None,
                       rollout_log_probs=None, tis_imp_ratio_cap=-1,
                       rollout_is_weights=None, params=None, cov_select=None)

``params`` (``PolicyLossParams``) carries the loss-specific settings (verl's
``actor.policy_loss.*`` keys: ``clip_cov_ratio``, ``kl_cov_ratio``, ``dro_beta`` ...);
``cov_select`` is an optional precomputed token selection for ``clip_cov`` / ``kl_cov``
(see rlhf/algos/policy_loss_cov.py).  A loss ignores the arguments it does not use.

All tensors are ``[B, T]``; ``loss`` is a scalar aggregated with ``agg_loss`` (pass the
mini-batch ``AggNorm`` so micro-batch / rank losses sum to the full-batch loss).  Metric
values are detached scalar tensors computed over the local micro-batch (masked means).

Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"): the sampler's log-probs differ from the trainer's, so
with ``tis_imp_ratio_cap > 0`` every per-token loss is multiplied by the constant weight
``min(exp(old_log_prob - rollout_log_probs), cap)`` before aggregation, as verl.
``rollout_is_weights`` (``[B, T]``, detached) are the rollout-correction / decoupled-PPO weights
of rlhf/algos/rollout_corr.py, multiplied into every per-token loss the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from rlhf.algos.aggregation import AggNorm, agg_loss
from rlhf.algos.masked import masked_mean, masked_sum

__all__ = [
    "PolicyLossParams",
    "PolicyLossFn",
    "POLICY_LOSS_REGISTRY",
    "register_policy_loss",
    "clamped_log_ratio",
    "finish_pg_loss",
    "get_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
]


@dataclass(frozen=True)
class PolicyLossParams:
    """Loss-specific settings; defaults are verl's.  Field -> config key (verl key):

    * ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``: ``actor.clip_cov_*``
      (``actor.policy_loss.clip_cov_*``), Clip-Cov.
    * ``kl_cov_ratio``, ``ppo_kl_coef``: ``actor.kl_cov_ratio`` / ``actor.ppo_kl_coef``
      (``actor.policy_loss.*``), KL-Cov.
    * ``dro_beta``: ``actor.dro_beta`` (``actor.policy_loss.dro_beta``), DRO; no default.
    * ``tau_pos``, ``tau_neg``: ``actor.tau_pos`` / ``actor.tau_neg`` (same in verl), SAPO.
    * ``rollout_is``, ``rollout_is_threshold``, ``loss_type``: ``actor.rollout_is``,
      ``actor.rollout_is_threshold``, ``actor.rollout_correction_loss_type``
      (``algorithm.rollout_correction.{rollout_is, rollout_is_threshold, loss_type}``), bypass mode.
    """

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    rollout_is: str = "token"
    rollout_is_threshold: float = 2.0
    loss_type: str = "ppo_clip"


DEFAULT_PARAMS = PolicyLossParams()


class PolicyLossFn(Protocol):
    def __call__(
        self,
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
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name``."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY[name] is not fn:
            raise ValueError(f"Policy loss {name!r} is already registered")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a policy loss by name; unknown names raise ``ValueError`` listing valid ones."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"Unknown policy loss_mode {name!r}; valid names: {', '.join(sorted(POLICY_LOSS_REGISTRY))}"
        )
    return POLICY_LOSS_REGISTRY[name]


def _tis_weight(
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    tis_imp_ratio_cap: float,
) -> torch.Tensor | None:
    """``min(pi_old / pi_rollout, cap)`` per token ``[B, T]``, or ``None`` when TIS is off."""
    if tis_imp_ratio_cap <= 0:
        return None
    if rollout_log_probs is None:
        raise ValueError(
            f"tis_imp_ratio_cap={tis_imp_ratio_cap} enables truncated importance sampling, "
            "which needs the sampler's `rollout_log_probs`; pass them or set tis_imp_ratio_cap=-1"
        )
    return torch.exp(old_log_prob - rollout_log_probs).clamp(max=tis_imp_ratio_cap).detach()


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """``log_prob - old_log_prob`` clamped to [-20, 20] (where verl clamps before ``exp``)."""
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def finish_pg_loss(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    *,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    tis_imp_ratio_cap: float,
    loss_agg_mode: str,
    norm: AggNorm | None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The common tail of token-level losses: the TIS weight (adds ``tis_imp_ratio_mean``), the
    rollout-correction weights ``[B, T]`` (rlhf/algos/rollout_corr.py; detached, as verl's
    ``rollout_is_weights``), ``agg_loss`` with the mini-batch ``norm``, and detached scalar metrics."""
    tis = _tis_weight(old_log_prob, rollout_log_probs, tis_imp_ratio_cap)
    if tis is not None:
        pg_losses = pg_losses * tis
        metrics["tis_imp_ratio_mean"] = masked_mean(tis, response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, norm)
    return loss, {k: torch.as_tensor(v, device=loss.device).detach() for k, v in metrics.items()}


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
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
    """PPO clipped surrogate with decoupled clip (DAPO) and dual clip.

    ``r_t = exp(clamp(log_prob - old_log_prob, -20, 20))``
    PPO (Schulman et al. 2017, eq. 7) with DAPO's clip-higher (Yu et al. 2025, eq. 10):
    ``L1_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))``
    Dual clip (Ye et al. 2020, eq. 5) bounds the loss of negative advantages:
    ``L_t = min(L1_t, -A_t c)`` if ``A_t < 0`` else ``L1_t``.

    Metrics: ``pg_clipfrac`` (share of tokens where the clipped term is active),
    ``pg_clipfrac_lower`` (dual clip active), ``clipfrac_high`` (``A>0`` and ``r > 1+eps_high``),
    ``clipfrac_low`` (``A<0`` and ``r < 1-eps_low``), ``ppo_kl`` (``mean(old - new)``), and with
    TIS ``tis_imp_ratio_mean``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    neg_approx_kl = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_approx_kl)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)

    with torch.no_grad():
        neg_adv = (advantages < 0).float()
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
            "pg_clipfrac_lower": masked_mean(torch.gt(clip_pg_losses1, pg_losses3).float() * neg_adv, response_mask),
            "clipfrac_high": masked_mean(
                ((ratio > 1 + clip_ratio_high) & (advantages > 0)).float(), response_mask
            ),
            "clipfrac_low": masked_mean(((ratio < 1 - clip_ratio_low) & (advantages < 0)).float(), response_mask),
            "ppo_kl": masked_mean(-neg_approx_kl, response_mask),
        }
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
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
    """Group Sequence Policy Optimization, GSPO-token form (Zheng et al. 2025, eq. 7 and 13).

    Sequence ratio ``s_i = exp(1/|y_i| sum_t (log_prob - old_log_prob))``; per token
    ``s_it = sg[s_i] * pi_t / sg[pi_t]`` (value ``s_i``, gradient ``s_i grad log pi_t``), computed
    in log space and clamped at ``log s_it <= 10`` as verl.
    ``L_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))``.

    The paper's objective is ``seq-mean-token-mean`` (the default here).  verl always uses that
    mode for GSPO and ignores the configured one; we honour ``loss_agg_mode`` so that every
    mode is available, and a trainer that wants verl's behaviour passes
    ``"seq-mean-token-mean"``.  ``clip_ratio_c`` is unused (GSPO has no dual clip);
    GSPO clip ranges are small (e.g. 3e-4 / 4e-4).

    Metrics: ``pg_clipfrac``, ``pg_clipfrac_lower`` (always 0), ``clipfrac_high``,
    ``clipfrac_low``, ``ppo_kl`` (token-level ``mean(old - new)``).
    """
    neg_approx_kl = log_prob - old_log_prob
    seq_len = response_mask.sum(dim=-1).clamp(min=1)
    neg_approx_kl_seq = masked_sum(neg_approx_kl, response_mask, dim=-1) / seq_len  # [B] log s_i
    log_seq_ratio = log_prob - log_prob.detach() + neg_approx_kl_seq.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))  # [B, T]

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
            "pg_clipfrac_lower": torch.zeros((), device=pg_losses.device),
            "clipfrac_high": masked_mean(
                ((seq_ratio > 1 + clip_ratio_high) & (advantages > 0)).float(), response_mask
            ),
            "clipfrac_low": masked_mean(
                ((seq_ratio < 1 - clip_ratio_low) & (advantages < 0)).float(), response_mask
            ),
            "ppo_kl": masked_mean(-neg_approx_kl, response_mask),
        }
    return finish_pg_loss(pg_losses, response_mask, metrics, old_log_prob=old_log_prob,
                          rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                          loss_agg_mode=loss_agg_mode, norm=norm, rollout_is_weights=rollout_is_weights)
