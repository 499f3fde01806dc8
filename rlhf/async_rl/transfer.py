"""What crosses between partners (see roles.py): rollout weights one way, rollout rows the other.

Weights. The training rank gathers its partner's rollout weights out of the training
layout (:func:`rlhf.rollout.reshard.gather_rollout_weights`: DTensor redistribute over
dp / tp, pp stages exchanged; sliced for the partner's rollout-TP rank) and sends them
as one flat buffer per dtype. With LoRA the first transfer carries the frozen base and
later ones only the adapters; the rollout rank keeps the base and merges
``W + (alpha / r) B A`` itself.

Rows. The rollout rank sends its partner the rows that the partner trains on (the
same rows, in the same order, the partner would have generated in colocated mode), with
the rollout statistics, as one pickled object.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlhf.models.lora import merged_weights_for_rollout
from rlhf.rollout.reshard import gather_rollout_weights

_LORA = ".lora_"


def _object_device(device: torch.device) -> Optional[torch.device]:
    return device if device.type == "cuda" else None


def send_object(obj: Any, dst: int, device: torch.device) -> None:
    dist.send_object_list([obj], dst=dst, device=_object_device(device))


def recv_object(src: int, device: torch.device) -> Any:
    box = [None]
    dist.recv_object_list(box, src=src, device=_object_device(device))
    return box[0]


def send_tensors(tensors: dict[str, torch.Tensor], dst: int, device: torch.device) -> int:
    """Names / shapes / dtypes as an object, then one flat buffer per dtype; returns bytes sent."""
    meta = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    send_object(meta, dst, device)
    sent = 0
    for dtype in sorted({m[2] for m in meta}, key=str):
        flat = torch.cat([tensors[n].reshape(-1) for n, _, d in meta if d == dtype]).to(device)
        dist.send(flat, dst=dst)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_tensors(src: int, device: torch.device) -> dict[str, torch.Tensor]:
    meta = recv_object(src, device)
    out: dict[str, torch.Tensor] = {}
    for dtype in sorted({m[2] for m in meta}, key=str):
        entries = [m for m in meta if m[2] == dtype]
        flat = torch.empty(sum(torch.Size(s).numel() for _, s, _ in entries), dtype=dtype, device=device)
        dist.recv(flat, src=src)
        offset = 0
        for n, shape, _ in entries:
            size = torch.Size(shape).numel()
            out[n] = flat[offset:offset + size].view(shape)
            offset += size
    return out


class WeightSender:
    """Training side: this rank's partner's rollout weights out of the training layout."""

    def __init__(self, partner: int, device: torch.device, *, dtype: Optional[torch.dtype], rollout_tp_rank: int,
                 rollout_tp: int, lora: bool):
        self.partner, self.device, self.dtype, self.lora = partner, device, dtype, lora
        self.tp_rank, self.tp = rollout_tp_rank, rollout_tp
        self.base_sent = False

    def send(self, model: torch.nn.Module) -> dict[str, float]:
        """A collective of the training mesh (the gather), then a send to the partner."""
        t0 = time.perf_counter()
        only_adapters = self.lora and self.base_sent
        weights, _ = gather_rollout_weights(model, dtype=self.dtype, pp_group=getattr(model, "pp_group", None),
                                            name_filter=(lambda n: _LORA in n) if only_adapters else None,
                                            tp_rank=self.tp_rank, tp_size=self.tp)
        t1 = time.perf_counter()
        sent = send_tensors(weights, self.partner, self.device)
        self.base_sent = True
        return {"async/weight_gather_s": t1 - t0, "async/weight_send_s": time.perf_counter() - t1,
                "async/weight_bytes": float(sent)}


class WeightReceiver:
    """Rollout side: the latest rollout weights (LoRA: the kept base merged with new adapters)."""

    def __init__(self, partner: int, device: torch.device, lora: Optional[tuple[float, int]]):
        self.partner, self.device, self.lora = partner, device, lora
        self.base: Optional[dict[str, torch.Tensor]] = None

    def recv(self) -> dict[str, torch.Tensor]:
        got = recv_tensors(self.partner, self.device)
        if self.lora is None:
            return got
        if self.base is None:
            self.base = {n: t for n, t in got.items() if _LORA not in n}
        alpha, rank = self.lora
        return merged_weights_for_rollout(self.base, {n: t for n, t in got.items() if _LORA in n}, alpha, rank)
