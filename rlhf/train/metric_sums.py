"""Per-metric weighted sums kept on the device during an update, read once at its end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.models.parallel import all_reduce_sum


@dataclass
class MetricSums:
    """Sums of (value x weight) and weights per metric, kept on the device: adding a micro-batch's
    metrics never waits for the device; :meth:`reduce` does one all-reduce and one ``.tolist()``."""

    sums: dict  # name -> float64 [2] tensor (sum of value x weight, sum of weights)
    device: torch.device

    @classmethod
    def new(cls, device):
        return cls({}, device)

    def _scalar(self, x: torch.Tensor | float) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.detach().to(self.device, torch.float64)
        return torch.full((), float(x), dtype=torch.float64, device=self.device)  # a fill, not a host copy

    def add(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        w = self._scalar(weight)
        pair = torch.stack([self._scalar(value) * w, w])
        old = self.sums.get(name)
        self.sums[name] = pair if old is None else old + pair

    def reduce(self, group=None) -> dict[str, float]:
        if not self.sums:
            return {}
        names = sorted(self.sums)
        t = all_reduce_sum(torch.stack([self.sums[n] for n in names]), group)  # [metrics, 2]
        return {n: s / w if w > 0 else 0.0 for n, (s, w) in zip(names, t.tolist())}
