"""The fully_async split on 4 gloo ranks, 2 training + 2 rollout: after StreamRoles.build each role
can still create groups among its own ranks alone (use_local_synchronization, as the layout, the
training mesh's group and the reward pool do). Such a group is named by a hash of the number of
groups each member holds; rank 0 is in every rollout rank's row group, so without fillers the two
training ranks named their group differently and waited for each other forever (the 2 + 2 job hung
at start-up)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist._dist_utils import dist_device, run_distributed


def _check(rank: int, world_size: int) -> None:
    from rlhf.config.load import load_config
    from rlhf.models.parallel import DistEnv
    from rlhf.train.async_rl.split import StreamRoles

    over = {"model.path": "m", "data.train_files": "t.parquet", "trainer.mode": "fully_async",
            "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4, "async_training.require_batches": 2,
            "parallel.rollout_ranks": 2, "trainer.exchange_timeout_s": 60}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()], check=lambda c: None)
    device = dist_device()
    roles = StreamRoles.build(cfg, DistEnv(rank, world_size, rank, device, dist.get_backend()))
    mine = [0, 1] if rank < 2 else [2, 3]
    assert roles.train_ranks == [0, 1] and roles.rollout_ranks == [2, 3] and roles.is_rollout == (rank >= 2)
    for _ in range(2):  # e.g. the mesh group, then the reward pool's
        g = dist.new_group(mine, use_local_synchronization=True)
        x = torch.tensor([float(rank)], device=device)
        dist.all_reduce(x, group=g)
        assert x.item() == sum(mine)
    x = torch.tensor([1.0], device=device)
    dist.all_reduce(x, group=roles.env.group)  # the role's own group
    assert x.item() == 2.0


def test_both_roles_create_local_groups_after_an_unequal_split():
    run_distributed(_check, 4, timeout_s=60)
