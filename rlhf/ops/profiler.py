"""torch.profiler traces of chosen steps, and NVTX ranges around the RL phases.

``trainer.profile_steps: [3, 4]`` records those steps with torch.profiler (CPU activity,
plus CUDA kernels when CUDA is there) and writes one chrome trace per rank and step to
``<output_dir>/profile/step_<k>/rank<r>.json`` (chrome://tracing or https://ui.perfetto.dev).
Every phase is an NVTX range on CUDA, so an ``nsys profile`` timeline shows the phases
without the torch profiler; while a step is profiled, phases are also labelled in its trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    """Starts torch.profiler at ``begin(step)`` for the chosen steps, writes the trace at ``end()``."""

    def __init__(self, steps: Sequence[int], out_dir: str | Path, rank: int, device: torch.device):
        self.steps = set(steps)
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.activities = [ProfilerActivity.CPU]
        if torch.device(device).type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._prof: Optional[profile] = None
        self._step = 0
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def begin(self, step: int) -> None:
        if step in self.steps and self._prof is None:
            self._step = step
            self._prof = profile(activities=self.activities, record_shapes=True, profile_memory=True)
            self._prof.__enter__()

    def end(self) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        path = self.out_dir / "profile" / f"step_{self._step}" / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(path))
        self.written.append(path)
        self._prof = None


class PhaseRanges:
    """A PhaseTimer listener: an NVTX range per phase on CUDA, a profiler label while profiling."""

    def __init__(self, cuda: bool, profiler: Optional[StepProfiler]):
        self.cuda, self.profiler = cuda, profiler
        self._labels: list = []

    def enter(self, phase: str, step: int) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(phase)
        label = None
        if self.profiler is not None and self.profiler.active:
            label = record_function(phase)
            label.__enter__()
        self._labels.append(label)

    def exit(self, phase: str, step: int) -> None:
        label = self._labels.pop()
        if label is not None:
            label.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.nvtx.range_pop()
