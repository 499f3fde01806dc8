"""The operations components around the training loop, built from ``trainer.*`` in one place.

The trainer sees four calls: :attr:`StepOps.listeners` (handed to its PhaseTimer, so every
phase is seen by the watchdog, the per-phase memory peaks, NVTX / profiler labels and the
out-of-memory test hook), :meth:`begin_step`, :meth:`end_step` (efficiency metrics and
health alerts) and :meth:`close`; :meth:`abort` ends the whole job with one line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from rlhf.ops.alerts import HealthMonitor
from rlhf.ops.efficiency import EfficiencyMeter
from rlhf.ops.memory import PeakMemory
from rlhf.ops.oom import InjectedOom
from rlhf.ops.profiler import PhaseRanges, StepProfiler
from rlhf.ops.watchdog import EXIT_CODE, start_watchdog


class InjectedDelay:
    """Test hook, a PhaseTimer listener added only when ``RLHF_TEST_SLOW_PHASES=<phase>:<seconds>[,...]``
    is set: entering one of those phases sleeps that long on every rank (a deliberately slow
    trainer, e.g. validation or the update outlasting ``trainer.collective_timeout_s``)."""

    def __init__(self, spec: str) -> None:
        self.delays = {phase: float(seconds) for phase, seconds in (item.split(":") for item in spec.split(","))}

    @classmethod
    def from_env(cls) -> "InjectedDelay | None":
        spec = os.environ.get("RLHF_TEST_SLOW_PHASES")
        return cls(spec) if spec else None

    def enter(self, phase: str, step: int) -> None:
        time.sleep(self.delays.get(phase, 0.0))

    def exit(self, phase: str, step: int) -> None:
        pass


class StepOps:
    """Watchdog, phase memory, profiler, NVTX ranges and MFU meter of one rank."""

    def __init__(self, cfg, env, hf_config, out_dir: Path):
        t = cfg.trainer
        device = env.device
        self.watchdog = start_watchdog(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                                       collective_timeout_s=t.collective_timeout_s,
                                       heartbeat_timeout_s=t.heartbeat_timeout_s)
        self.memory = PeakMemory(device)
        self.profiler = StepProfiler(t.profile_steps, out_dir, env.rank, device) if t.profile_steps else None
        compute_dtype = torch.bfloat16 if device.type == "cuda" and cfg.model.mixed_precision else \
            getattr(torch, cfg.model.dtype)
        self.efficiency = EfficiencyMeter(hf_config, device, compute_dtype, world_size=env.world_size,
                                          ppo_epochs=cfg.actor.ppo_epochs, group=env.group)
        # Metrics are global, so every rank reaches the same verdict; rank 0 prints it.
        self.health = HealthMonitor(t.alerts, warn=(lambda line: print(line, flush=True)) if env.is_main else None)
        parts = (self.watchdog, self.memory, PhaseRanges(device.type == "cuda", self.profiler),
                 InjectedOom.from_env(env.rank), InjectedDelay.from_env())
        self.listeners = [p for p in parts if p is not None]

    def begin_step(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.begin(step)

    def end_step(self, step: int, batch, metrics: dict[str, float], dp_group) -> dict[str, float]:
        """Global MFU, tokens/s per device, per-phase peak memory and health alerts of the step that
        just ended (``metrics``: the step's metrics so far)."""
        if self.profiler is not None:
            self.profiler.end()
        response = batch.response_mask.sum()
        times = {k: metrics.get(f"timing/{k}", 0.0) for k in ("step", "generate", "update")}
        out = self.efficiency.step_metrics(prompt_tokens=batch.attention_mask.sum() - response,
                                           response_tokens=response, n_seqs=len(batch), times=times,
                                           peaks=self.memory.pop(), dp_group=dp_group)
        return {**out, **self.health.check(step, metrics)}

    def abort(self, line: str) -> NoReturn:
        """End every rank of the job now (through the watchdog's store key when there is one)."""
        if self.watchdog is not None:
            self.watchdog.abort(line)
        print(line, file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.end()
        if self.watchdog is not None:
            self.watchdog.finish()
