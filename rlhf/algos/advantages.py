"""Advantage estimators, chosen by name (verl's ``algorithm.adv_estimator`` values).

Every estimator has the same keyword-only signature (``AdvantageEstimatorFn``) and returns
``(advantages [B, T], returns [B, T])``, zero outside ``response_mask`` unless stated.
Arguments an estimator does not use are accepted and ignored, so a trainer calls them all
the same way::

    adv, ret = get_adv_estimator(cfg.adv_estimator)(
        token_level_rewards=r, response_mask=m, index=prompt_ids, values=v, gamma=1.0, lam=1.0)

Outcome-reward estimators use the sequence score ``s_i = sum_t r_it m_it`` and a baseline over
the group of responses sharing a prompt (``index``).  Group statistics are computed with
``index_add_`` / ``scatter_reduce`` (no Python loop over samples).  Degenerate groups follow
verl: a group of one has mean 0 and std 1; a group whose scores are all equal gets exactly
zero advantage (verl can return rounding noise divided by ``epsilon`` there; we zero it).

Numbers match verl's ``verl/trainer/ppo/core_algos.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from rlhf.algos.distill import opd_advantages
from rlhf.algos.masked import masked_sum, masked_whiten
from rlhf.algos.reward_shaping import place_reward_on_last_token

__all__ = [
    "AdvantageEstimatorFn",
    "ADV_ESTIMATOR_REGISTRY",
    "register_adv_estimator",
    "get_adv_estimator",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_opd_advantage",
    "group_ids",
    "sequence_scores",
]

GroupIndex = torch.Tensor | np.ndarray | Sequence[Any]


class AdvantageEstimatorFn(Protocol):
    """Uniform estimator signature; shapes ``[B, T]`` unless noted."""

    def __call__(
        self,
        *,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: GroupIndex | None = None,
        values: torch.Tensor | None = None,
        reward_baselines: torch.Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
        norm_adv_by_std_in_grpo: bool = True,
        epsilon: float = 1e-6,
        whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten,
        global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        reward_components: torch.Tensor | None = None,
        reward_weights: Sequence[float] | None = None,
        old_log_probs: torch.Tensor | None = None,
        sum_pi_squared: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        teacher_log_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``whiten(values, mask)`` normalises over "the batch"; the trainer passes one whose
        statistics are all-reduced over data-parallel ranks, so whitening estimators (gae,
        reinforce_plus_plus, reinforce_plus_plus_baseline, gdpo) do not depend on the layout.
        ``global_sum(t)`` sums a tensor over those ranks (identity by default), for estimators
        whose scale depends on batch-wide counts (gpg).  ``reward_components [B, K]`` and
        ``reward_weights [K]`` feed gdpo; ``old_log_probs``, ``sum_pi_squared`` and
        ``rollout_is_weights`` (all ``[B, T]``) feed the optimal token baselines; ``teacher_log_probs``
        ``[B, T]`` (with ``old_log_probs``) feeds opd.  Estimators
        accept and ignore the arguments they do not use."""


ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimatorFn] = {}


def register_adv_estimator(name: str) -> Callable[[AdvantageEstimatorFn], AdvantageEstimatorFn]:
    """Decorator: register an estimator under ``name`` (a second, different fn is an error)."""

    def decorator(fn: AdvantageEstimatorFn) -> AdvantageEstimatorFn:
        if name in ADV_ESTIMATOR_REGISTRY and ADV_ESTIMATOR_REGISTRY[name] is not fn:
            raise ValueError(f"Advantage estimator {name!r} is already registered")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvantageEstimatorFn:
    """Look up an estimator by name; unknown names raise ``ValueError`` listing valid ones."""
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"Unknown adv_estimator {name!r}; valid names: {', '.join(sorted(ADV_ESTIMATOR_REGISTRY))}"
        )
    return ADV_ESTIMATOR_REGISTRY[name]


# ----------------------------------------------------------------------------- group statistics


def group_ids(index: GroupIndex, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels ``[B]`` (ints, strings, uuids) to dense ids ``[B]`` in ``[0, G)``."""
    if isinstance(index, torch.Tensor):
        uniq, inv = torch.unique(index.reshape(-1), return_inverse=True)
        return inv.to(device=device, dtype=torch.long), int(uniq.numel())
    uniq, inv = np.unique(np.asarray(index), return_inverse=True)
    return torch.as_tensor(inv.reshape(-1), dtype=torch.long, device=device), len(uniq)


@dataclass(frozen=True)
class _GroupStats:
    """Per-sample view ``[B]`` of the statistics of the sample's group."""

    count: torch.Tensor  # group size
    mean: torch.Tensor  # group mean (verl's 0 for a group of one)
    std: torch.Tensor  # unbiased group std (verl's 1 for a group of one)
    constant: torch.Tensor  # bool: every score in the group is equal
    max: torch.Tensor  # group maximum
    gid: torch.Tensor  # dense group id
    n_groups: int


def _group_stats(scores: torch.Tensor, index: GroupIndex | None) -> _GroupStats:
    if index is None:
        raise ValueError("this advantage estimator needs `index` (group id of each sample, [B])")
    if len(index) != scores.shape[0]:
        raise ValueError(f"`index` has {len(index)} entries but the batch has {scores.shape[0]} samples")
    gid, n_groups = group_ids(index, scores.device)
    zeros = scores.new_zeros(n_groups)
    count_g = zeros.index_add(0, gid, torch.ones_like(scores))
    mean_g = zeros.index_add(0, gid, scores) / count_g
    # Two-pass variance (as torch.std) rather than E[x^2]-E[x]^2, which cancels badly.
    sq_dev_g = zeros.index_add(0, gid, (scores - mean_g[gid]) ** 2)
    std_g = (sq_dev_g / (count_g - 1).clamp(min=1)).sqrt()
    max_g = zeros.scatter_reduce(0, gid, scores, reduce="amax", include_self=False)
    min_g = zeros.scatter_reduce(0, gid, scores, reduce="amin", include_self=False)

    count = count_g[gid]
    single = count <= 1
    return _GroupStats(
        count=count,
        mean=torch.where(single, torch.zeros_like(scores), mean_g[gid]),
        std=torch.where(single, torch.ones_like(scores), std_g[gid]),
        constant=(max_g == min_g)[gid],
        max=max_g[gid],
        gid=gid,
        n_groups=n_groups,
    )


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score ``s_i = sum_t r_it m_it`` ``[B, T] -> [B]``: rewards at masked positions
    (tool outputs, padding) never count, in every estimator."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _zero_if_constant(centered: torch.Tensor, stats: _GroupStats) -> torch.Tensor:
    # A group of one keeps its (uncentred) score, as verl; only real groups are zeroed.
    return torch.where(stats.constant & (stats.count > 1), torch.zeros_like(centered), centered)


# ----------------------------------------------------------------------------- estimators


@register_adv_estimator("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16), PPO with a critic.

    ``delta_t = r_t + gamma V_{t+1} - V_t``,  ``A_t = delta_t + gamma lam A_{t+1}``,
    ``R_t = A_t + V_t``; masked-out positions are skipped (they pass ``V`` and ``A`` through),
    so the TD error of the last token before a masked tool-output span bootstraps from the
    value of the next *generated* token, and neither ``gamma`` nor ``lam`` is applied across
    the span (verl's multi-turn GAE); rewards and values at masked positions are ignored.
    Then ``A`` is whitened over the mask of the whole batch (as verl).

    Shapes: ``token_level_rewards``, ``values``, ``response_mask`` ``[B, T]`` ->
    ``advantages [B, T]`` (whitened), ``returns [B, T]`` (not whitened).
    """
    if values is None:
        raise ValueError("adv_estimator 'gae' needs `values` (critic values, [B, T])")
    mask = response_mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    # A loop over time is inherent to the recursion; each step is vectorised over the batch.
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    advantages = whiten(advantages, response_mask)
    return advantages, returns


@register_adv_estimator("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath eq. 3 / sec. 4.1.2).

    ``A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon)`` broadcast over the response tokens;
    ``std`` is the unbiased std of the group.  With ``norm_adv_by_std_in_grpo=False`` it is
    Dr.GRPO's ``A_i = s_i - mean_g(s)`` (Liu et al. 2025, eq. 4).

    Shapes: ``token_level_rewards``, ``response_mask`` ``[B, T]``; ``index [B]`` ->
    ``(advantages, returns)`` both ``[B, T]`` and equal.
    """
    scores = sequence_scores(token_level_rewards, response_mask)  # [B]
    stats = _group_stats(scores, index)
    adv = _zero_if_constant(scores - stats.mean, stats)
    if norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + epsilon)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, eq. 7).

    ``A_i = s_i - 1/(n-1) sum_{j != i} s_j = n/(n-1) (s_i - mean_g(s))``; a group of one keeps
    ``A_i = s_i`` (verl).  Shapes: ``[B, T]`` in, ``(advantages, returns) [B, T]`` out, equal.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    n = stats.count
    loo = (scores - stats.mean) * n / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, loo, scores)
    adv = _zero_if_constant(adv, stats)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, eq. 6).

    ``b = sum_j |y_j| s_j / sum_j |y_j|`` over the group (length-weighted mean),
    ``A_i = s_i - b``; a group of one has ``b = 0`` (verl).  ``|y_j|`` counts generated tokens
    (``response_mask``), the terms of the policy gradient; masked tool outputs do not count.
    Shapes: ``[B, T]`` in, ``(advantages, returns) [B, T]`` out, equal.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    stats = _group_stats(scores, index)
    gid = stats.gid
    zeros = scores.new_zeros(stats.n_groups)
    weighted_g = zeros.index_add(0, gid, lengths * scores)
    length_g = zeros.index_add(0, gid, lengths)
    baseline = weighted_g[gid] / length_g[gid].clamp(min=1e-8)
    baseline = torch.where(stats.count > 1, baseline, torch.zeros_like(baseline))
    adv = _zero_if_constant(scores - baseline, stats)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, eq. 7-9): discounted return, whitened over the whole batch.

    ``G_t = r_t + gamma G_{t'}`` with ``t'`` the next *generated* position (``mask = 1``):
    masked positions are skipped, so an outcome reward reaches the tokens before a masked
    tool-output span (no discount for the span), and the returns on the mask equal those of
    the same response with the holes removed (verl's multi-turn GAE semantics; verl issue
    #7278 / PR #7300 for REINFORCE++, which used to reset the return at every masked position).
    Rewards on masked positions (tool outputs, padding) are ignored.
    ``A = whiten_batch(G) * mask``.  Shapes: ``[B, T]`` -> ``advantages [B, T]``, ``returns [B, T]``
    (0 off the mask).
    """
    keep = response_mask.bool()
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        running = torch.where(keep[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    advantages = whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, sec. 3): group-mean baseline, then batch whitening.

    ``A_it = whiten_batch(s_i - mean_g(s)) * m_it`` (group of one: mean 0).
    Shapes: ``[B, T]`` in, ``(advantages, returns) [B, T]`` out, equal.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    centered = _zero_if_constant(scores - stats.mean, stats)
    adv = centered.unsqueeze(-1) * response_mask
    adv = whiten(adv, response_mask) * response_mask
    return adv, adv


@register_adv_estimator("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, eq. 7): baseline = reward of the greedy response to the prompt.

    ``G_t = sum_{k>=t} r_k m_k``, ``A_t = (G_t - b) m_t`` with ``b = reward_baselines [B]``.
    Shapes: ``[B, T]`` -> ``advantages [B, T]``, ``returns [B, T]``.
    """
    if reward_baselines is None:
        raise ValueError("adv_estimator 'remax' needs `reward_baselines` (greedy-rollout reward, [B])")
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    # verl leaves the reward-to-go on masked positions inside a response; zero them like every estimator
    advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k-optimised GRPO (verl ``grpo_passk``; Walder & Karkhanis 2025, "Pass@K Policy
    Optimization"): only the best response of each group is reinforced, by its margin over the
    runner-up, ``A_i = (s_max - s_2nd) / (std_g(s) + eps)`` for ``i = argmax_g s`` (first on ties),
    0 for the others; without ``norm_adv_by_std_in_grpo`` the margin is not divided.
    Groups need >= 2 samples. Shapes: ``[B, T]`` in, ``(advantages, returns) [B, T]`` out, equal.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    if bool((stats.count < 2).any()):
        raise ValueError("adv_estimator 'grpo_passk' needs >= 2 samples per prompt (rollout.n >= 2)")
    gid, G, B = stats.gid, stats.n_groups, scores.shape[0]
    # best = lowest row index among the group's maxima; runner-up = max over the other rows
    rows = torch.arange(B, device=scores.device)
    best_row = torch.full((G,), B, dtype=torch.long, device=scores.device).scatter_reduce(
        0, gid, torch.where(scores == stats.max, rows, torch.full_like(rows, B)), reduce="amin")
    is_best = rows == best_row[gid]
    neg_inf = torch.full_like(scores, float("-inf"))
    second = neg_inf[:G].scatter_reduce(0, gid, torch.where(is_best, neg_inf, scores), reduce="amax")
    margin = stats.max - second[gid]
    if norm_adv_by_std_in_grpo:
        margin = margin / (stats.std + epsilon)
    adv = torch.where(is_best, margin, torch.zeros_like(scores))
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (Chu et al. 2025, "GPG", eq. 6-7; verl ``gpg``):
    ``A_i = alpha (s_i - mean_g(s))`` with the batch correction ``alpha = B / M``, ``M`` the
    number of samples with a non-zero score (as verl counts them), over the global batch
    (``global_sum``). No std division. Pair with ``actor.policy_loss: gpg``.
    Shapes: ``[B, T]`` in, ``(advantages, returns) [B, T]`` out, equal.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    counts = torch.stack([torch.tensor(float(scores.shape[0]), dtype=torch.float64, device=scores.device),
                          (scores != 0).sum().double()])
    if global_sum is not None:
        counts = global_sum(counts)
    alpha = float(counts[0] / counts[1].clamp(min=1))
    adv = _zero_if_constant(scores - stats.mean, stats) * alpha
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("gdpo")
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group reward-Decoupled normalization Policy Optimization (Liu et al. 2026, "GDPO",
    arXiv 2601.05242, eq. 4-6; verl ``gdpo``), for several rewards per response.

    GRPO on the summed reward lets the largest-variance reward decide the sign; GDPO
    normalises each reward ``k`` within its group first, sums with weights, then whitens
    over the whole batch's response tokens:
    ``A_i = whiten_batch( sum_k w_k grpo_k(i) )`` with ``grpo_k(i) = (r_ik - mean_g r_k) /
    (std_g r_k + eps)`` (no std division without ``norm_adv_by_std_in_grpo``).

    Shapes: ``reward_components [B, K]`` (``algorithm.gdpo_reward_keys``, in that order),
    ``reward_weights [K]`` (``algorithm.gdpo_reward_weights``, default all 1); without
    components the summed ``token_level_rewards [B, T]`` is the single reward (verl's
    fallback).  ``(advantages, returns) [B, T]``, equal.
    """
    if reward_components is None:
        reward_components = sequence_scores(token_level_rewards, response_mask).unsqueeze(-1)
    K = reward_components.shape[-1]
    weights = [1.0] * K if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != K:
        raise ValueError(f"gdpo has {K} reward components but {len(weights)} weights "
                         "(algorithm.gdpo_reward_keys vs algorithm.gdpo_reward_weights)")
    combined = torch.zeros_like(response_mask, dtype=torch.float32)
    for k in range(K):
        per_k = place_reward_on_last_token(reward_components[:, k].float(), response_mask)
        adv_k, _ = compute_grpo_outcome_advantage(
            token_level_rewards=per_k, response_mask=response_mask, index=index,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, epsilon=epsilon)
        combined = combined + weights[k] * adv_k
    adv = whiten(combined, response_mask) * response_mask
    return adv, adv


@register_adv_estimator("opd")
@torch.no_grad()
def compute_opd_advantage(
    *,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Thinking Machines 2025; verl ``distillation`` with ``use_policy_gradient``):
    ``A_t = log q_teacher(y_t) - log pi_old(y_t)`` per token, the negative per-token reverse KL
    (:func:`rlhf.algos.distill.opd_advantages`). Task rewards are not used; no group baseline,
    so ``n = 1`` works. Shapes ``[B, T]`` -> ``(advantages, returns)`` ``[B, T]``, equal.
    """
    if old_log_probs is None or teacher_log_probs is None:
        raise ValueError("adv_estimator 'opd' needs the student's old log-probs and the teacher's log-probs: "
                         "set distill.enabled=true with a distill.teachers entry")
    return opd_advantages(old_log_probs, teacher_log_probs, response_mask)
