"""Shard first, then place: a loaded model reaches the device as this rank's shards only.

A model loaded from an HF checkpoint sits on the host in its master dtype. Moving it to
the device before ``fully_shard`` (or letting TP / FSDP2 move each unit whole) would
hold the whole model (a 7B fp32 model: 30 GB) on every GPU for a moment. Instead:

1. :func:`params_to_meta` keeps the host tensors aside (no copy) and puts every
   parameter on the meta device; buffers (rotary ``inv_freq``) stay real;
2. TP and FSDP2 are applied to the meta model (they only record placements);
3. :func:`materialize_shards` copies, for each parameter, exactly this rank's slice of
   the host tensor to the device (or to the host, for FSDP2 CPU offload).

So the device holds ``1/(dp x tp)`` of the stage plus nothing transient, and the same
code runs on CPU / gloo, where tests drive it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Activation checkpointing wraps blocks; the names of the host tensors are the unwrapped ones.
_WRAPPER = "_checkpoint_wrapped_module."


def _plain_name(name: str) -> str:
    return name.replace(_WRAPPER, "")


def params_to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` to the meta device; returns ``{name: host tensor}`` (tied
    parameters under each of their names, the same tensor). Parameter objects (and so ties
    and ``requires_grad``) are kept; only their data moves."""
    host: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:  # built on meta (rlhf.simulate): nothing to move, the host tensor is the meta one
            seen.setdefault(id(p), p)
        if id(p) not in seen:
            seen[id(p)] = p.detach()
            with torch.no_grad():
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"),
                                                         requires_grad=p.requires_grad))
        host[_plain_name(name)] = seen[id(p)]
    return host


def place(piece: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of ``piece`` on ``device`` (the only host-to-device traffic of the load)."""
    out = torch.empty(piece.shape, dtype=piece.dtype, device=device)
    return out.copy_(piece)


def local_piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` for the (meta) parameter ``like``: the
    slice its DTensor placements give this rank (FSDP2 ``Shard(0)`` chunks, TP shards and
    their strided compositions), or ``full`` for a plain tensor."""
    if not isinstance(like, DTensor):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"host tensor {tuple(full.shape)} does not match the parameter {tuple(like.shape)}")
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for s, o in zip(shape, offset))]


@torch.no_grad()
def materialize_shards(model: nn.Module, host: dict[str, torch.Tensor], device: torch.device) -> int:
    """Give every meta parameter of ``model`` this rank's slice of its ``host`` tensor on ``device``.

    The parameter objects stay the same (``swap_tensors``), so ties, FSDP2's references and
    ``requires_grad`` survive; FSDP2 re-reads its sharded parameters at its lazy init (as
    after ``load_state_dict``). Returns the bytes placed on ``device``.
    """
    placed = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        name = _plain_name(name)
        if not p.is_meta:  # a tied alias already filled
            host.pop(name, None)
            continue
        if name not in host:
            raise KeyError(f"no host tensor for meta parameter {name}")
        # Dropped as soon as its shard is placed: host memory holds the model, not model + shards.
        local = place(local_piece(host.pop(name), p), device)
        placed += local.numel() * local.element_size()
        if isinstance(p, DTensor):
            local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
        torch.utils.swap_tensors(p, nn.Parameter(local, requires_grad=p.requires_grad))
    return placed
