"""Bounded staleness for trainer.mode fully_async: AReaL's admission rule and the staleness metrics.

Pure functions (no process group). Versions count updates: theta_v is the policy after v
optimizer updates; the training role pushes theta_v after every ``trigger_parameter_sync_step``-th
update. Prompts are numbered in the seeded data order (position ``s = (batch - 1) x B + i``).
"""

from __future__ import annotations

import math

import torch


def admission_bound(version: int, batch_prompts: int, trigger: int, staleness_threshold: float) -> int:
    """Prompts (data-order positions ``s < bound``) the rollout role may have started while it holds theta_version.

    AReaL's capacity rule (Fu et al. 2025, "AReaL", Sec. 5.1), in prompts: with one sync window
    ``W = trigger x B`` (B = prompts per update) and ``v`` updates consumed, accepted + in-flight
    prompts stay within ``(1 + eta)`` windows ahead of the consumer:

        bound = v * B + floor((1 + eta) * W)

    ``eta = 0, trigger = 1`` admits batch v+1 only once theta_v is loaded: the synchronous schedule.
    """
    if staleness_threshold < 0 or trigger < 1:
        raise ValueError(f"staleness_threshold must be >= 0 and trigger >= 1, got {staleness_threshold}, {trigger}")
    return version * batch_prompts + math.floor((1 + staleness_threshold) * trigger * batch_prompts + 1e-9)


def staleness_metrics(token_versions: torch.Tensor, mask: torch.Tensor, trained_version: int) -> dict[str, float]:
    """Staleness of the response tokens of one whole batch: ``trained_version - version`` of each
    token ([N, R] versions, [N, R] 0/1 mask, holes allowed), mean and max over the masked tokens."""
    m = mask.bool()
    lag = (trained_version - token_versions.to(torch.float64))[m]
    if lag.numel() == 0:
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    return {"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max())}


def idle_share(idle_s: float, wall_s: float) -> float:
    """Fraction of ``wall_s`` spent idle (0 when no time passed)."""
    return float(min(max(idle_s / wall_s, 0.0), 1.0)) if wall_s > 0 else 0.0


class IdleClock:
    """One rank's idle share per cycle of its own (one_step_off's rollout rank: generate a batch, then
    wait to hand it over and for the next weights). ``wait(s)`` books idle seconds; ``lap(now)`` ends
    the cycle: the share of its wall time that was idle, the cycle's idle seconds. A share of the
    rank's own cycle, as fully_async's ``async/rollout_idle_share`` is of its wall time: dividing the
    idle seconds by another rank's step time is no share (it exceeds 1 when the cycles differ)."""

    def __init__(self, now: float):
        self.t, self.idle_s = now, 0.0

    def wait(self, seconds: float) -> None:
        self.idle_s += seconds

    def lap(self, now: float) -> tuple[float, float]:
        out = idle_share(self.idle_s, now - self.t), self.idle_s
        self.t, self.idle_s = now, 0.0
        return out


def uses_rollout_log_probs(cfg) -> bool:
    """fully_async with ``async_training.use_rollout_log_probs`` (verl's name): the sampler's per-token
    log-probs (each under the weights that produced the token) are the old policy's."""
    return cfg.trainer.mode == "fully_async" and cfg.async_training.use_rollout_log_probs


def skips_old_log_prob_pass(cfg, actor) -> bool:
    """Whether the trainer can skip its old-log-prob forward: under :func:`uses_rollout_log_probs`,
    unless that pass also records a MoE actor's routes (router replay). The pass is a third of the
    training rank's step, the fully_async bottleneck; the cost is the ``actor/entropy`` metric. Also under
    ``rollout.batch_invariant`` with ``actor.use_rollout_log_probs``, in any mode."""
    if cfg.rollout.batch_invariant and cfg.actor.use_rollout_log_probs:  # bitwise the trainer's (actor.py)
        return True
    return uses_rollout_log_probs(cfg) and getattr(actor, "router_replay", None) is None
