"""The unequal role split of trainer.mode fully_async: T training ranks, G rollout ranks.

Global ranks ``[0, T)`` train on their own ``(pp, dp, sp, tp)`` mesh; ranks ``[T, T + G)`` each
run an independent rollout replica (rollout.tp = 1). Rollout rank ``g`` takes its weights from
training rank ``(g - T) % T`` (every training rank holds the whole rollout copy after the gather,
so the pushes spread over the training ranks) and streams its finished groups to the training
leader, rank 0, which assembles each batch and deals it to the training ranks. Each direction of
each (training rank, rollout rank) pair has its own group, so a blocking receive in a thread
never meets the other direction's messages; all of them wait ``trainer.exchange_timeout_s``.
Every rank creates every group here, before the roles part ways.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlhf.models.parallel import DistEnv, ParallelDims
from rlhf.rollout.reshard import RolloutLayout
from rlhf.schema.config import Config, ConfigError
from rlhf.train.async_rl.roles import Roles


def rollout_rank_count(cfg: Config, world_size: int) -> int:
    """G: ``rollout.nnodes x rollout.n_gpus_per_node`` (verl) when set, else ``parallel.rollout_ranks``, else half."""
    r = cfg.rollout
    if r.nnodes > 0 and r.n_gpus_per_node > 0:
        return r.nnodes * r.n_gpus_per_node
    return cfg.parallel.rollout_ranks or world_size // 2


def check_fully_async(cfg: Config, world_size: int) -> tuple[int, int]:
    """(T, G); one-line errors for splits and features the mode cannot run yet."""
    mode = "trainer.mode=fully_async"
    g = rollout_rank_count(cfg, world_size)
    if not 1 <= g < world_size:
        raise ConfigError(f"{mode}: {g} rollout ranks (parallel.rollout_ranks or rollout.nnodes x "
                          f"rollout.n_gpus_per_node) must leave 1 to {world_size - 1} of the {world_size} ranks "
                          f"to train; launch more ranks or change the split")
    a, at = cfg.async_training, "async_training"
    b = cfg.data.train_batch_size
    if a.require_batches * cfg.actor.ppo_mini_batch_size != b:
        raise ConfigError(f"{at}.require_batches x actor.ppo_mini_batch_size = {a.require_batches} x "
                          f"{cfg.actor.ppo_mini_batch_size} must equal data.train_batch_size ({b}): an update "
                          f"takes that many prompts' groups")
    if a.trigger_parameter_sync_step < 1 or a.staleness_threshold < 0:
        raise ConfigError(f"{at}.trigger_parameter_sync_step must be >= 1 and {at}.staleness_threshold >= 0")
    synchronous = a.staleness_threshold == 0 and a.trigger_parameter_sync_step == 1
    if not synchronous and not cfg.actor.corrects_off_policy and not a.use_rollout_log_probs:
        raise ConfigError(f"{mode}: with {at}.staleness_threshold > 0 or trigger_parameter_sync_step > 1 batches "
                          f"come from older policies; set actor.tis_imp_ratio_cap (truncated IS, e.g. 2.0), "
                          f"actor.rollout_is_decoupled or actor.use_decoupled_loss")
    alg = cfg.algorithm
    for bad, what in ((cfg.rollout.tp != 1, "rollout.tp > 1 (each rollout rank is one replica)"),
                      (cfg.parallel.sp != 1, "parallel.sp > 1"),
                      (alg.filter_groups.enable, "algorithm.filter_groups"),
                      (alg.adv_estimator == "remax", "algorithm.adv_estimator=remax")):
        if bad:
            raise ConfigError(f"{mode} does not support {what} yet; use trainer.mode=one_step_off or colocated")
    return world_size - g, g


@dataclass
class StreamRoles(Roles):
    """:class:`Roles` of an unequal split, with the pair groups of both directions."""

    train_ranks: list[int] = field(default_factory=list)
    rollout_ranks: list[int] = field(default_factory=list)
    weight_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)  # rollout rank -> {its source, it}
    row_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)  # rollout rank -> {0, it}

    def weight_source(self, g: int) -> int:
        """The training rank that pushes weights to rollout rank ``g``."""
        return (g - len(self.train_ranks)) % len(self.train_ranks)

    def weight_targets(self) -> list[int]:
        return [g for g in self.rollout_ranks if self.weight_source(g) == self.env.rank]

    @classmethod
    def build(cls, cfg: Config, env: DistEnv) -> "StreamRoles":
        t, g = check_fully_async(cfg, env.world_size)
        p = cfg.parallel
        dims = ParallelDims.resolve(p.dp, p.tp, p.pp, t, sp=1)
        # The training mesh over ranks [0, T): built by every rank (its groups are world collectives).
        mesh = DeviceMesh(env.device.type, torch.arange(t).view(dims.pp, dims.dp, 1, dims.tp),
                          mesh_dim_names=("pp", "dp", "sp", "tp"))
        train, rollout = list(range(t)), list(range(t, t + g))
        timeout = datetime.timedelta(seconds=cfg.trainer.exchange_timeout_s)
        weight_groups, row_groups = {}, {}
        for r in rollout:
            weight_groups[r] = dist.new_group([(r - t) % t, r], timeout=timeout)
            row_groups[r] = dist.new_group([0, r], timeout=timeout)
        # A group of one role's ranks alone (use_local_synchronization: the layout's, the mesh's, the reward
        # pool's) is named by a hash of the number of groups each member holds, so every training rank must
        # hold as many as rank 0, which is in every row group: one-rank fillers (every rank calls new_group).
        held = {k: sum((r - t) % t == k for r in rollout) + (len(rollout) if k == 0 else 0) for k in train}
        for k in train:
            for _ in range(max(held.values()) - held[k]):
                dist.new_group([k])
        in_rollout = env.rank >= t
        ranks = rollout if in_rollout else train
        if in_rollout:  # independent replicas: a layout of one, and a group naming the role
            layout = RolloutLayout()
            layout.group = dist.new_group(ranks, use_local_synchronization=True)
        else:
            layout = RolloutLayout.build(cfg.rollout.tp, env.device.type, ranks=train,
                                         exchange_timeout_s=cfg.trainer.exchange_timeout_s)
            if layout.group is None:
                layout.group = dist.new_group(train, use_local_synchronization=True)
        partner = (env.rank - t) % t if in_rollout else -1
        return cls(role="rollout" if in_rollout else "train",
                   env=replace(env, world_size=len(ranks), group=layout.group),
                   mesh=mesh, layout=layout, partner=partner, size=len(ranks), pair_group=None,
                   train_ranks=train, rollout_ranks=rollout, weight_groups=weight_groups, row_groups=row_groups)
