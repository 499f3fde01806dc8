"""Optimal Token Baseline (OTB): a per-token, variance-weighted group baseline.

Li et al. 2026, "Optimal Token Baseline" (arXiv 2602.07078); verl ``optimal_token_baseline``
and ``tir_optimal_token_baseline``.  For the REINFORCE gradient ``sum_t grad log pi(y_t) G_t``
the variance-minimising baseline at step ``t`` weights each trajectory by the squared norm of
its score function up to ``t``.  With the logit-gradient proxy
``||grad_z log pi(y_j)||^2 = ||e_{y_j} - pi_j||^2 = 1 - 2 pi_j(y_j) + sum_v pi_j(v)^2`` that
needs only forward quantities:

    W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_j(v)^2)             (realised energy, [B, T])
    B_t = sum_{i in g} G_t^i W_t^i / (sum_{i in g} W_t^i + eps)  (per group g and step t)
    A_t = (G_t - B_t) * mask_t,   G_t = sum_{s>=t} r_s           (reward-to-go)

With rollout importance weights ``rho`` (``actor.rollout_is``) each step's energy is scaled
by ``rho_t^2``.  A group of one gets no baseline (``A = G``).  ``handle_zero_tail``: the steps
of a group's single longest trajectory past the second-longest one have no peer, so their
baseline is 0 there (verl's default).

``tir_optimal_token_baseline`` is the tool-integrated variant: a response with masked tool
outputs (holes in ``response_mask``) is compacted to its model tokens first, so step ``t`` is
the t-th *generated* token of every trajectory; use it for multi-turn rollouts.  The plain
variant compares trajectories position by position (a hole is a step where that trajectory
has no token; its zero tail starts where the second-longest trajectory *ends*, not at its
token count).  On contiguous masks both give the same numbers.

Groups never span ranks (a prompt's samples are contiguous on one rank), so nothing here
is reduced over data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.algos.advantages import GroupIndex, group_ids, register_adv_estimator
from rlhf.algos.masked import mask_end

__all__ = [
    "sum_pi_squared_from_logits",
    "compute_optimal_token_baseline_advantage",
    "compute_tir_optimal_token_baseline_advantage",
    "TOKEN_BASELINE_ESTIMATORS",
]

TOKEN_BASELINE_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(z)_v^2 = exp(logsumexp(2z) - 2 logsumexp(z))``; ``[..., V] -> [...]`` fp32."""
    z = logits.float()
    return torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))


def _inputs(old_log_probs: torch.Tensor | None, sum_pi_squared: torch.Tensor | None, name: str) -> None:
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(f"adv_estimator {name!r} needs old_log_probs and sum_pi_squared ([B, T]); "
                         "the trainer computes them when this estimator is configured")


def _group_baseline(returns: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor, index: GroupIndex | None,
                    handle_zero_tail: bool, epsilon: float) -> torch.Tensor:
    """Per-group, per-step baseline ``[B, T]`` from aligned ``returns``, ``energy``, ``mask``."""
    if index is None:
        raise ValueError("optimal token baselines need `index` (group id of each sample, [B])")
    B, T = returns.shape
    gid, G = group_ids(index, returns.device)
    valid_row = mask.sum(-1) > 0
    w = energy * mask
    num = returns.new_zeros(G, T).index_add(0, gid, returns * w)
    den = returns.new_zeros(G, T).index_add(0, gid, w)
    # A step no trajectory of the group reaches has num = den = 0: baseline 0 (also at epsilon 0).
    baseline = torch.where(den != 0, num / (den + epsilon), torch.zeros_like(num))[gid]  # [B, T]
    count = returns.new_zeros(G).index_add(0, gid, valid_row.to(returns.dtype))[gid]
    baseline = torch.where((count > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        # Trajectories are compared by where they end, not by token count: with holes in the
        # mask a row can end later than it has tokens, and step t is a position here.
        lengths = mask_end(mask).to(returns.dtype)
        longest = lengths.new_full((G,), -1.0).scatter_reduce(0, gid, lengths, reduce="amax")
        is_longest = lengths == longest[gid]
        n_longest = returns.new_zeros(G).index_add(0, gid, is_longest.to(returns.dtype))[gid]
        second = lengths.new_full((G,), -1.0).scatter_reduce(
            0, gid, torch.where(is_longest, torch.full_like(lengths, -1.0), lengths), reduce="amax")[gid]
        alone = is_longest & (n_longest == 1) & (second >= 0) & (count > 1)
        past = torch.arange(T, device=returns.device).unsqueeze(0) >= second.unsqueeze(-1)
        baseline = torch.where(alone.unsqueeze(-1) & past, torch.zeros_like(baseline), baseline)
    return baseline


def _energy(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor,
            rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    step = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        step = step * rollout_is_weights ** 2
    return (step * mask).cumsum(dim=-1)


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rewards * mask).flip(-1).cumsum(-1).flip(-1)


@register_adv_estimator("optimal_token_baseline")
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB on positions of the padded batch (module docstring).  ``[B, T]`` in;
    ``advantages [B, T]`` (zero off the mask) and ``returns`` = reward-to-go ``[B, T]``."""
    _inputs(old_log_probs, sum_pi_squared, "optimal_token_baseline")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    energy = _energy(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    baseline = _group_baseline(returns, energy, mask, index, handle_zero_tail, epsilon)
    return (returns - baseline) * mask, returns


@register_adv_estimator("tir_optimal_token_baseline")
@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB over generated tokens only: each row's masked positions are compacted to the left
    (a stable sort on the mask), the baseline is taken step by step there, and the advantages
    are scattered back.  ``[B, T]`` in; ``(advantages, returns)`` ``[B, T]``."""
    _inputs(old_log_probs, sum_pi_squared, "tir_optimal_token_baseline")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    energy = _energy(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    # order[b] lists row b's model-token positions first, in order, then the holes.
    order = torch.sort((mask == 0).to(torch.int8), dim=-1, stable=True).indices
    lengths = mask.sum(-1, keepdim=True)
    compact_mask = (torch.arange(mask.shape[-1], device=mask.device).unsqueeze(0) < lengths).to(mask.dtype)
    c_returns = returns.gather(-1, order) * compact_mask
    c_energy = energy.gather(-1, order) * compact_mask
    c_adv = (c_returns - _group_baseline(c_returns, c_energy, compact_mask, index, handle_zero_tail, epsilon))
    adv = torch.zeros_like(returns).scatter(-1, order, c_adv * compact_mask)
    return adv * mask, returns
