"""Asynchronous RL: trainer.mode one_step_off (roles.py, pipeline.py, rollout_worker.py, transfer.py) and
fully_async (split.py, fully_async.py, stream_worker.py, staleness.py; the sampler run is rlhf/rollout/stream.py)."""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from rlhf.schema.config import Config
from rlhf.train.checkpoint import find_resume_path


def run_async(cfg: Config, trainer_factory: Callable, *, dry_run: bool = False):
    """Every rank: split the world; training ranks build the trainer from ``trainer_factory`` and
    fit, rollout ranks run the rollout loop. Returns the trainer on training ranks, else None."""
    from rlhf.models.parallel import init_distributed
    from rlhf.train.async_rl.roles import Roles

    env = init_distributed(cfg.trainer.device, timeout_s=cfg.trainer.collective_timeout_s)
    fully = cfg.trainer.mode == "fully_async"
    if fully:
        from rlhf.train.async_rl.split import StreamRoles

        roles = StreamRoles.build(cfg, env)
    else:
        roles = Roles.build(cfg, env)
    watchdog = None
    if fully and not dry_run:  # one watchdog over both roles: a stopped rank of either is named
        from rlhf.ops.watchdog import job_watchdog

        t = cfg.trainer
        watchdog = job_watchdog(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                                collective_timeout_s=t.collective_timeout_s, heartbeat_timeout_s=t.heartbeat_timeout_s,
                                role=None if roles.is_rollout else "train")
    # Decided once, before any rank can write a checkpoint, so both roles start from the same step.
    box = [str(p) if (p := find_resume_path(cfg.checkpoint.resume, cfg.trainer.output_dir)) else None]
    dist.broadcast_object_list(box, src=0, device=env.device if env.device.type == "cuda" else None)
    if roles.is_rollout and fully:
        from rlhf.train.async_rl.stream_worker import StreamWorker

        worker = StreamWorker(cfg, roles, box[0])
        if not dry_run:
            if watchdog is not None:
                worker.on_phase = watchdog.enter
                watchdog.enter("stream_generate", 0)
            worker.run()
            if watchdog is not None:
                watchdog.finish()
        return None
    if roles.is_rollout:
        from rlhf.train.async_rl.rollout_worker import RolloutWorker

        worker = RolloutWorker(cfg, roles, box[0])
        if not dry_run:
            worker.run()
        return None
    trainer = trainer_factory(cfg, dry_run=dry_run, roles=roles)
    if not dry_run:
        trainer.fit()
    return trainer


def training_side(roles, cfg: Config, trainer):
    """The training role's end of the exchange with the rollout role, for ``trainer`` (an RLTrainer
    whose mesh, rollout dtype and step count are set): one_step_off's :class:`OneStepOff` or
    fully_async's :class:`FullyAsync`."""
    if cfg.trainer.mode == "fully_async":
        from rlhf.train.async_rl.fully_async import FullyAsync

        return FullyAsync(roles, cfg, device=trainer.device, dtype=trainer.rollout.dtype,
                          total_steps=trainer.total_steps, dp_rank=trainer.dp_rank, dp=trainer.dims.dp,
                          dp_group=trainer.dp_group)
    from rlhf.train.async_rl.pipeline import OneStepOff

    return OneStepOff(roles, device=trainer.device, dtype=trainer.rollout.dtype, rollout_tp=cfg.rollout.tp,
                      lora=cfg.model.lora_rank > 0, total_steps=trainer.total_steps,
                      stop_after_steps=cfg.trainer.stop_after_steps, tis_cap=cfg.actor.tis_imp_ratio_cap,
                      dp_group=trainer.dp_group)
