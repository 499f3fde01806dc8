"""Peak memory of each phase: ``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU.

On CPU the kernel's high-water mark of the resident set (``VmHWM``) is reset when a phase
starts by writing ``5`` to ``/proc/self/clear_refs`` (Linux), so each phase reports its own
peak; where that is refused, the process-lifetime peak (``ru_maxrss``) is what is reported.
Phases nest (``score`` holds ``reward_fn``): resetting for the inner phase would lose the
outer phase's peak so far, so an inner phase's peak is folded into every open outer phase.
"""

from __future__ import annotations

import resource
import sys

import torch


def _read_hwm_bytes() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss) * (1.0 if sys.platform == "darwin" else 1024.0)


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PeakMemory:
    """A PhaseTimer listener: this rank's peak bytes per phase since the last :meth:`pop`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peaks: dict[str, float] = {}
        self._open: list[list] = []  # [phase, peak of nested phases so far]

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_hwm()

    def _read(self) -> float:
        return float(torch.cuda.max_memory_allocated(self.device)) if self.cuda else _read_hwm_bytes()

    def enter(self, phase: str, step: int) -> None:
        if self._open:  # the outer phase's peak up to here
            self._open[-1][1] = max(self._open[-1][1], self._read())
        self._open.append([phase, 0.0])
        self._reset()

    def exit(self, phase: str, step: int) -> None:
        name, nested = self._open.pop()
        peak = max(nested, self._read())
        self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        if self._open:
            self._open[-1][1] = max(self._open[-1][1], peak)

    def pop(self) -> dict[str, float]:
        out, self.peaks = self.peaks, {}
        return out
