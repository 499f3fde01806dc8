"""On-policy distillation signals: pure functions of student and teacher log-probs.

On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models",
GKD; Thinking Machines 2025, "On-Policy Distillation"): the student ``pi`` samples
``y ~ pi(. | x)``, a frozen teacher ``q`` scores every sampled token, and the student minimises
the reverse KL ``KL(pi || q)`` on its own trajectories. Per token the one-sample (k1) estimate is

    KL_t = log pi(y_t | x, y_<t) - log q(y_t | x, y_<t)                                   (1)

and ``-KL_t`` is a dense per-token reward. Two ways to use it (both in the policy gradient,
with any policy loss, verl's ``use_policy_gradient``):

* as the advantage estimator (``algorithm.adv_estimator: opd``): ``A_t = -KL_t`` (2), no
  group baseline, so ``rollout.n = 1`` is allowed;
* as an additive term on any estimator's advantages (slime's ``--opd-kl-coef``):
  ``A'_t = A_t - c * KL_t`` (3).

GKD's generalized Jensen-Shannon divergence over the whole next-token distribution is
:func:`generalized_jsd` (a loss on logits, for supervised use).

Every function is right on masks with holes (multi-turn tool trajectories): tokens with
``mask = 0`` (tool outputs, padding, unmapped cross-tokenizer spans) get 0 and count nowhere.
Shapes: ``[B, T]`` = rows x response tokens; logits ``[B, T, V]``.
"""

from __future__ import annotations

import torch

__all__ = ["reverse_kl", "opd_advantages", "add_opd_term", "distill_sums", "generalized_jsd"]


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of ``KL(pi || q)`` (eq. 1) on the sampled tokens, 0 outside ``mask``.

    Shapes: all ``[B, T]`` -> ``[B, T]``. Its expectation under ``y ~ pi`` is the reverse KL;
    a single token's value can be negative.
    """
    return (student_log_probs - teacher_log_probs) * mask


@torch.no_grad()
def opd_advantages(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OPD as an advantage estimator (eq. 2): ``A_t = log q(y_t) - log pi(y_t)`` per token.

    No discounting over later tokens (Thinking Machines' discount 0): each token is judged by the
    teacher on its own. Shapes ``[B, T]`` -> ``(advantages, returns)`` both ``[B, T]`` and equal,
    0 outside ``mask``. Exactly 0 everywhere when the teacher is the student.
    """
    adv = -reverse_kl(student_log_probs, teacher_log_probs, mask)
    return adv, adv


@torch.no_grad()
def add_opd_term(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                 mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Eq. 3, slime's form: ``A'_t = A_t - coef * KL_t`` on masked tokens; ``A_t`` unchanged where
    ``KL_t`` is 0 (teacher = student) or ``mask`` is 0. Shapes ``[B, T]`` -> ``[B, T]``."""
    return advantages - coef * reverse_kl(student_log_probs, teacher_log_probs, mask)


def distill_sums(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """``[sum KL_t, sum log q_t, tokens]`` (float64, ``[3]``) over masked tokens, for global means:
    sum these over data-parallel ranks, then divide by the token count, so the logged
    ``distill/reverse_kl`` and ``distill/teacher_logprob_mean`` do not depend on the layout."""
    m = mask.double()
    return torch.stack([((student_log_probs.double() - teacher_log_probs.double()) * m).sum(),
                        (teacher_log_probs.double() * m).sum(), m.sum()])


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *,
                    beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """GKD's generalized JSD per token (Agarwal et al. 2024, eq. in sec. 3; TRL's ``beta``), ``[B, T]``.

    With ``P = softmax(teacher / T)``, ``Q = softmax(student / T)`` and ``M = beta P + (1 - beta) Q``:

        JSD_beta = beta KL(P || M) + (1 - beta) KL(Q || M)          for 0 < beta < 1,

    and the limits TRL uses at the ends: ``beta = 0`` forward KL ``KL(P || Q)``, ``beta = 1`` reverse
    KL ``KL(Q || P)``. Summed over the vocabulary, 0 outside ``mask``; differentiable in the
    student's logits. Shapes: logits ``[B, T, V]``, mask ``[B, T]``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        per = (t.exp() * (t - s)).sum(-1)
    elif beta == 1.0:
        per = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([t + torch.log(torch.tensor(beta)),
                                         s + torch.log(torch.tensor(1.0 - beta))]), dim=0)
        m = torch.where(t == s, s, m)  # exactly 0 where the distributions agree (no log-sum-exp rounding)
        per = beta * (t.exp() * (t - m)).sum(-1) + (1.0 - beta) * (s.exp() * (s - m)).sum(-1)
    return per * mask
