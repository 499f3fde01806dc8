"""Sampler stats logged as rollout/* are global over the rollout replicas, not one replica's."""

from __future__ import annotations

import torch.distributed as dist

from tests.dist._dist_utils import run_distributed


def _check(rank: int, world_size: int) -> None:
    from rlhf.rollout.engine import global_rollout_stats

    mine = [{"tokens_generated": 30.0, "num_sequences": 4.0, "seconds": 2.0, "kv_peak_tokens": 64.0,
             "slot_utilisation": 0.5, "turns": 3.0, "observation_tokens": 12.0, "parked_preemptions": 1.0},
            {}][rank]  # rank 1: a replica that got no prompts
    out = global_rollout_stats(mine, dist.group.WORLD, multi_turn=True)
    assert out["tokens_generated"] == 30.0 and out["num_sequences"] == 4.0 and out["turns"] == 3.0
    assert out["observation_tokens"] == 12.0 and out["parked_preemptions"] == 1.0
    assert out["seconds"] == 2.0 and out["kv_peak_tokens"] == 64.0 and out["tokens_per_s"] == 15.0
    assert out["slot_utilisation"] == 0.5  # the mean over replicas that decoded
    single = global_rollout_stats({"tokens_generated": 8.0, "seconds": 4.0}, None)
    assert single["tokens_per_s"] == 2.0 and "turns" not in single


def test_rollout_stats_are_summed_or_maxed_over_replicas():
    run_distributed(_check, 2)
