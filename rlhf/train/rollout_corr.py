"""The rollout-correction phase of a step: after the old log-probs, before the advantages.

Applies the decoupled-mode corrections of ``rlhf/algos/rollout_corr.py`` to the batch in place:
rejection sampling and the token veto shrink ``batch.response_mask`` (rejected tokens leave the
loss and its normaliser, as verl), the IS weights (``actor.rollout_is_decoupled``) or AReaL's
behaviour weights (``actor.use_decoupled_loss``) go to ``batch.rollout_is_weights``, which the
actor multiplies into the per-token policy loss.  The batch-normalised weights and every
``mismatch/*`` metric are global over the data-parallel group.
"""

from __future__ import annotations

import torch

from rlhf.algos.rollout_corr import (decoupled_behav_weights, is_weights, mismatch_metrics, rejection_mask,
                                     token_veto_mask)
from rlhf.models.parallel import all_reduce_max, all_reduce_sum
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import ActorConfig

__all__ = ["apply_rollout_correction"]


@torch.no_grad()
def apply_rollout_correction(batch: RolloutBatch, cfg: ActorConfig, dp_group) -> dict[str, float]:
    """Correct ``batch`` (needs ``old_log_probs``) for the rollout/training mismatch; returns the
    ``mismatch/*`` metrics (always logged: they cost one all-reduce)."""
    if batch.old_log_probs is None:
        return {}
    old, roll, mask = batch.old_log_probs, batch.rollout_log_probs, batch.response_mask
    log_ratio = old - roll
    gsum = lambda t: all_reduce_sum(t, dp_group)  # noqa: E731
    weights, metrics = None, {}
    if cfg.rollout_is_decoupled:
        weights, factor = is_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold,
                                     cfg.rollout_is_batch_normalize, global_sum=gsum)
        if cfg.rollout_is_batch_normalize:
            metrics["mismatch/is_batch_norm_factor"] = float(factor)
    elif cfg.use_decoupled_loss:
        weights = decoupled_behav_weights(old, roll, mask, cfg.behav_imp_weight_cap)
    kept = None
    if cfg.rollout_rs:
        kept = rejection_mask(log_ratio, mask, cfg.rollout_rs, cfg.rollout_rs_threshold,
                              cfg.rollout_rs_threshold_lower)
    if cfg.rollout_token_veto_threshold > 0:
        veto = token_veto_mask(log_ratio, mask, cfg.rollout_token_veto_threshold)
        kept = veto if kept is None else kept * veto
    stats = mismatch_metrics(old, roll, mask, weights=weights, kept=kept, global_sum=gsum,
                             global_max=lambda t: all_reduce_max(t, dp_group))
    metrics.update({k: float(v) for k, v in stats.items()})
    if kept is not None:
        batch.response_mask = kept.to(mask.dtype)
    batch.rollout_is_weights = weights
    return metrics
