"""KL estimators, KL-coefficient controllers, KL-in-reward and token entropy.

Estimators follow Schulman, "Approximating KL divergence" (2020) and verl's ``kl_penalty``:
with ``x = logprob - ref_logprob`` (samples from the current policy),

* ``kl`` / ``k1``:            ``x``
* ``abs``:                    ``|x|``
* ``mse`` / ``k2``:           ``0.5 x^2``
* ``low_var_kl`` / ``k3``:    ``exp(-x) - (-x) - 1``, with ``-x`` clamped to ``[-20, 20]`` and the
  result clamped to ``[-10, 10]`` for numerical stability.
"""

from __future__ import annotations

import torch

from rlhf.algos.masked import masked_mean

__all__ = [
    "KL_PENALTY_NAMES",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "KLController",
    "get_kl_controller",
    "apply_kl_penalty",
    "entropy_from_logits",
]

KL_PENALTY_NAMES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` between the policy and the reference (see module doc)."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ValueError(f"Unknown kl_penalty {kl_penalty!r}; valid names: {', '.join(KL_PENALTY_NAMES)}")


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-tuning LMs from human preferences", eq. 2).

    ``e = clip(KL / KL_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``;
    ``n_steps`` is the number of sequences in the batch (prompts x rollout.n; verl passes the batch size).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs horizon > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def update_kl_controller(ctrl: KLController, current_kl: float, prompts: int, n: int) -> None:
    """One step of the controller after a batch of ``prompts`` x ``n`` responses: verl's ``n_steps``
    is the number of sequences in the batch (its ``batch_size[0]`` after the n-fold repeat), not prompts."""
    ctrl.update(current_kl, n_steps=prompts * n)


def get_kl_controller(
    type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """Build a controller by verl's ``algorithm.kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown kl_ctrl type {type!r}; valid types: fixed, adaptive")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward (Ouyang et al. 2022, eq. 2): ``r_t = score_t - beta * KL_t * m_t``.

    Shapes: all ``[B, T]``.  Returns ``(token_level_rewards [B, T], metrics)``; metrics holds
    scalar tensors only: ``kl`` = batch mean of the per-sequence masked token-mean KL (verl's
    ``current_kl``, logged as ``actor/reward_kl_penalty``).  The caller feeds the controller the
    mean over *all* dp ranks (``ctrl.update(global_kl, n_steps=global_batch_size)``) so that
    every rank keeps the same coefficient; this function stays free of communication.
    """
    kld = _kl(old_log_prob, ref_log_prob, kl_penalty)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld)) * response_mask  # padding may be nan
    token_level_rewards = token_level_scores - kl_coef * kld
    kl_per_seq = masked_mean(kld, response_mask, dim=-1)  # [B]
    return token_level_rewards, {"kl": kl_per_seq.mean()}


# ``apply_kl_penalty`` has a parameter named like the estimator function; keep a private alias.
_kl = kl_penalty


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` over the last dim.

    Shape: ``[..., V]`` -> ``[...]``.  Stable for large logits (no ``log(softmax)`` underflow);
    the logits must be finite.
    """
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
