"""Entropy-collapse tooling: the entropy-coefficient schedule and the log-prob/advantage
covariance that drives entropy change (Cui et al. 2025, "The Entropy Mechanism of RL for
Reasoning Language Models", eq. 3: under softmax policy gradient the step's entropy change
is about ``-Cov(log pi(y_t), A_t)`` over the batch's tokens).

Both are logged each step (``actor/entropy_coeff``, ``actor/cov_logp_adv``) next to the
per-step ``actor/entropy``, so a collapse shows as a positive covariance and a falling entropy
before accuracy stalls; clip_cov / kl_cov (rlhf/algos/policy_loss_cov.py) act on it.
"""

from __future__ import annotations

import math

import torch

ENTROPY_SCHEDULES = ("constant", "linear", "cosine")


def entropy_coeff_at(step: int, total_steps: int, start: float, final: float, schedule: str = "constant") -> float:
    """Entropy coefficient of update ``step`` (0-based) of ``total_steps``.

    constant: ``start``; linear: ``start + (final - start) * s``; cosine:
    ``final + (start - final) (1 + cos(pi s)) / 2``, with ``s = step / max(total_steps - 1, 1)``
    clamped to [0, 1] (the first update uses ``start``, the last ``final``).
    """
    if schedule not in ENTROPY_SCHEDULES:
        raise ValueError(f"entropy_coeff_schedule must be one of {ENTROPY_SCHEDULES}, got {schedule!r}")
    if schedule == "constant":
        return start
    s = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)
    if schedule == "linear":
        return start + (final - start) * s
    return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * s))


@torch.no_grad()
def covariance_sums(log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[sum A l, sum A, sum l, N]`` over masked tokens (float64), to all-reduce over ranks."""
    m = mask.double()
    a, lp = advantages.double() * m, log_prob.double() * m
    return torch.stack([(a * log_prob.double()).sum(), a.sum(), lp.sum(), m.sum()])


def covariance_from_sums(sums: torch.Tensor) -> float:
    """``Cov(l, A) = E[A l] - E[A] E[l]`` from (reduced) :func:`covariance_sums`; 0 with no token."""
    s_al, s_a, s_l, n = (float(x) for x in sums)
    if n <= 0:
        return 0.0
    return s_al / n - (s_a / n) * (s_l / n)
