"""What crosses between partners (see roles.py): rollout weights one way, rollout rows the other.

Weights. The training rank gathers its partner's rollout weights out of the training
layout (:func:`rlhf.rollout.reshard.gather_rollout_weights`: DTensor redistribute over
dp / tp, pp stages exchanged; sliced for the partner's rollout-TP rank) and sends them
tensor by tensor, small ones packed into one reusable buffer (:func:`send_tensors`); the
partner receives each into its own tensor (:func:`recv_tensors`). All of it goes over the
pair's own group (``Roles.pair_group``, timeout ``trainer.exchange_timeout_s``). With LoRA the first transfer carries the frozen base and
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


def is_adapter(name: str) -> bool:
    """A LoRA adapter tensor (PEFT names): what crosses after the first transfer."""
    return _LORA in name


def gather_push(model: torch.nn.Module, *, dtype: Optional[torch.dtype], lora: bool, base_sent: bool,
                tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The rollout weights a training rank pushes (a collective of the training mesh). LoRA: the frozen
    base crosses once (``base_sent`` False), later pushes carry only the adapters."""
    weights, _ = gather_rollout_weights(model, dtype=dtype, pp_group=getattr(model, "pp_group", None),
                                        name_filter=is_adapter if lora and base_sent else None,
                                        tp_rank=tp_rank, tp_size=tp_size)
    return weights


def _object_device(device: torch.device) -> Optional[torch.device]:
    return device if device.type == "cuda" else None


def send_object(obj: Any, dst: int, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> None:
    dist.send_object_list([obj], dst=dst, device=_object_device(device), group=group)


def recv_object(src: int, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> Any:
    box = [None]
    dist.recv_object_list(box, src=src, device=_object_device(device), group=group)
    return box[0]


# Bytes of the one reusable buffer the sender packs small tensors into (the planner counts it).
SEND_BUCKET_BYTES = 256 * 2**20


def message_groups(sizes: list[int], bucket: int) -> list[list[int]]:
    """The tensors (indices into ``sizes``, element counts of one dtype's tensors in order) of
    each message: consecutive tensors packed up to ``bucket`` elements; a tensor of ``bucket``
    elements or more travels alone (sent from its own memory, no copy); empty tensors are not
    sent. Both sides compute the same groups from the sizes."""
    groups: list[list[int]] = []
    current: list[int] = []
    fill = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if current and (n >= bucket or fill + n > bucket):
            groups.append(current)
            current, fill = [], 0
        if n >= bucket:
            groups.append([i])
        else:
            current.append(i)
            fill += n
    if current:
        groups.append(current)
    return groups


def _bucket_numel(bucket_bytes: int, dtype: torch.dtype) -> int:
    return max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())


def send_tensors(tensors: dict[str, torch.Tensor], dst: int, device: torch.device,
                 group: Optional[dist.ProcessGroup] = None, bucket_bytes: int = SEND_BUCKET_BYTES) -> int:
    """Names / shapes / dtypes as an object, then the tensors of each dtype as the messages of
    :func:`message_groups`; returns bytes sent. Consumes ``tensors``: each is dropped once
    sent, and small ones are packed into one reusable buffer filled in place, so the sender
    never holds a second copy of the weights (``torch.cat`` of everything did)."""
    meta = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    send_object((meta, bucket_bytes), dst, device, group)
    sent = 0
    for dtype in sorted({m[2] for m in meta}, key=str):
        names = [n for n, _, d in meta if d == dtype]
        sizes = [tensors[n].numel() for n in names]
        bucket = _bucket_numel(bucket_bytes, dtype)
        buffer: Optional[torch.Tensor] = None
        for members in message_groups(sizes, bucket):
            parts = [tensors.pop(names[i]).reshape(-1) for i in members]
            if sizes[members[0]] >= bucket:
                msg = parts[0].to(device).contiguous()
            else:
                if buffer is None:
                    buffer = torch.empty(min(bucket, sum(sizes)), dtype=dtype, device=device)
                msg, offset = buffer[:sum(sizes[i] for i in members)], 0
                for t in parts:  # filled in place (copy_ also brings a host tensor to the device)
                    msg[offset:offset + t.numel()].copy_(t)
                    offset += t.numel()
            del parts
            dist.send(msg, dst=dst, group=group)
            sent += msg.numel() * msg.element_size()
        for n in names:  # the empty ones
            tensors.pop(n, None)
    return sent


def recv_tensors(src: int, device: torch.device, group: Optional[dist.ProcessGroup] = None
                 ) -> dict[str, torch.Tensor]:
    """The tensors of :func:`send_tensors`, each in its own memory (a large one received in
    place, small ones through one reusable buffer), so whoever consumes them (the sampler
    fusing q|k|v) can free each one: views of one flat buffer would keep them all alive."""
    meta, bucket_bytes = recv_object(src, device, group)
    out = {n: torch.empty(shape, dtype=dtype, device=device) for n, shape, dtype in meta}
    for dtype in sorted({m[2] for m in meta}, key=str):
        names = [n for n, _, d in meta if d == dtype]
        sizes = [out[n].numel() for n in names]
        bucket = _bucket_numel(bucket_bytes, dtype)
        buffer: Optional[torch.Tensor] = None
        for members in message_groups(sizes, bucket):
            if sizes[members[0]] >= bucket:
                dist.recv(out[names[members[0]]].view(-1), src=src, group=group)
                continue
            if buffer is None:
                buffer = torch.empty(min(bucket, sum(sizes)), dtype=dtype, device=device)
            msg, offset = buffer[:sum(sizes[i] for i in members)], 0
            dist.recv(msg, src=src, group=group)
            for i in members:
                out[names[i]].view(-1).copy_(msg[offset:offset + sizes[i]])
                offset += sizes[i]
    return out


class WeightSender:
    """Training side: this rank's partner's rollout weights out of the training layout."""

    def __init__(self, partner: int, device: torch.device, *, dtype: Optional[torch.dtype], rollout_tp_rank: int,
                 rollout_tp: int, lora: bool, group: Optional[dist.ProcessGroup] = None):
        self.partner, self.device, self.dtype, self.lora, self.group = partner, device, dtype, lora, group
        self.tp_rank, self.tp = rollout_tp_rank, rollout_tp
        self.base_sent = False

    def send(self, model: torch.nn.Module) -> dict[str, float]:
        """A collective of the training mesh (the gather), then a send to the partner."""
        t0 = time.perf_counter()
        weights = gather_push(model, dtype=self.dtype, lora=self.lora, base_sent=self.base_sent,
                              tp_rank=self.tp_rank, tp_size=self.tp)
        t1 = time.perf_counter()
        sent = send_tensors(weights, self.partner, self.device, self.group)  # consumes weights
        self.base_sent = True
        return {"async/weight_gather_s": t1 - t0, "async/weight_send_s": time.perf_counter() - t1,
                "async/weight_bytes": float(sent)}


class WeightReceiver:
    """Rollout side: the latest rollout weights (LoRA: the kept base merged with new adapters)."""

    def __init__(self, partner: int, device: torch.device, lora: Optional[tuple[float, int]],
                 group: Optional[dist.ProcessGroup] = None):
        self.partner, self.device, self.lora, self.group = partner, device, lora, group
        self.base: Optional[dict[str, torch.Tensor]] = None

    def recv(self) -> dict[str, torch.Tensor]:
        return self.merged(recv_tensors(self.partner, self.device, self.group))

    def merged(self, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Received tensors -> rollout weights: LoRA's first message holds the base (kept), each one the adapters."""
        if self.lora is None:
            return got
        if self.base is None:
            self.base = {n: t for n, t in got.items() if not is_adapter(n)}
        alpha, rank = self.lora
        return merged_weights_for_rollout(self.base, {n: t for n, t in got.items() if is_adapter(n)}, alpha, rank)
