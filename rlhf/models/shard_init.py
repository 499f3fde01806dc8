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

A model loaded with ``load_causal_lm(..., deferred=True)`` has no host tensors: its meta
parameters carry sources (:mod:`rlhf.models.checkpoint_reader`) from which step 3 reads only
this rank's slice, in the checkpoint dtype, and upcasts it to the parameter's dtype as it
places it. Step 3 runs staggered by local rank (``model.load_ranks_per_node``), so a node's
peak host memory at load is bounded by the ranks that read at once.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rlhf.models.checkpoint_reader import CheckpointSlice, HFLoad
from rlhf.schema.config import ConfigError

# What a parameter's data comes from: a host tensor, or a reader of the checkpoint's slices.
Source = Union[torch.Tensor, CheckpointSlice, HFLoad]

# Activation checkpointing wraps blocks; the names of the host tensors are the unwrapped ones.
_WRAPPER = "_checkpoint_wrapped_module."


def _plain_name(name: str) -> str:
    return name.replace(_WRAPPER, "")


def params_to_meta(model: nn.Module) -> dict[str, Source]:
    """Every parameter of ``model`` to the meta device; returns ``{name: host tensor}`` (tied
    parameters under each of their names, the same tensor). Parameter objects (and so ties
    and ``requires_grad``) are kept; only their data moves. A parameter already on meta with
    a source from a deferred load gives that source (and drops its own reference to it)."""
    host: dict[str, Source] = {}
    seen: dict[int, Source] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen and p.is_meta and hasattr(p, "_rlhf_source"):
            seen[id(p)] = p._rlhf_source
            del p._rlhf_source
        elif p.is_meta:  # built on meta (rlhf.simulate): nothing to move, the host tensor is the meta one
            seen.setdefault(id(p), p)
        elif id(p) not in seen:
            seen[id(p)] = p.detach()
            with torch.no_grad():
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"),
                                                         requires_grad=p.requires_grad))
        host[_plain_name(name)] = seen[id(p)]
    return host


def place(piece: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy of ``piece`` on ``device`` in ``dtype`` (default: its own): the only
    host-to-device traffic of the load, and where a checkpoint-dtype shard is upcast. A meta piece (a
    model built without weights: rlhf.simulate, also with CPU offload) stays on meta."""
    out = torch.empty(piece.shape, dtype=dtype or piece.dtype, device="meta" if piece.is_meta else device)
    return out if piece.is_meta else out.copy_(piece)


def local_piece(full: Source, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` for the (meta) parameter ``like``: the
    slice its DTensor placements give this rank (FSDP2 ``Shard(0)`` chunks, TP shards and
    their strided compositions), or ``full`` for a plain tensor. A checkpoint source reads
    only that slice."""
    if isinstance(full, HFLoad):
        full = full.take()
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"host tensor {tuple(full.shape)} does not match the parameter {tuple(like.shape)}")
    if not isinstance(like, DTensor):
        index = tuple(slice(0, s) for s in like.shape)
    else:
        shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
        index = tuple(slice(o, o + s) for s, o in zip(shape, offset))
    return full.read(index) if isinstance(full, CheckpointSlice) else full[index]


def _check_finite(piece: torch.Tensor, name: str, where: str) -> None:
    # Each rank checks its own slices; together they cover every weight.
    if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
        bad = int((~torch.isfinite(piece)).sum())
        raise ConfigError(f"{where}: weight {name} holds {bad} non-finite value(s) (NaN/inf) in this rank's "
                          f"slice {tuple(piece.shape)}")


def load_turns(ranks_per_node: int, host: dict[str, Source]) -> int:
    """How many ranks of a node read and place their shards at once (``model.load_ranks_per_node``;
    0 = auto: all when every source reads only this rank's slices, else as many whole checkpoints
    in their own dtype as fit 80% of the node's available memory, agreed over all ranks)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if ranks_per_node > 0:
        return min(ranks_per_node, local)
    whole = [s for s in host.values() if isinstance(s, HFLoad)]
    if not whole:
        return local
    fit = max(1, int(0.8 * _available_memory() // max(1, whole[0].nbytes)))
    if dist.is_initialized():  # the same count on every node, or their barriers would not pair up
        t = torch.tensor([min(fit, local)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group())
        return int(t.item())
    return min(fit, local)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


_CPU_GROUP: dict[int, Any] = {}


def _cpu_group():
    # A gloo group for host-side coordination, whatever the device backend (one per world group).
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUP:
        _CPU_GROUP[key] = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return _CPU_GROUP[key]


def staggered(fn: Callable[[], Any], at_once: int) -> Any:
    """Run ``fn`` on every rank, ``at_once`` local ranks of each node at a time (by local rank);
    every rank passes the same number of barriers. ``fn`` must not run a collective."""
    local, local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized() or at_once >= local:
        return fn()
    out = None
    for turn in range(-(-local // at_once)):
        if local_rank // at_once == turn:
            out = fn()
        dist.barrier(group=_cpu_group())
    return out


@torch.no_grad()
def _release_freed_host_memory() -> None:
    # The slices read and freed between the placed shards leave holes in the C heap that glibc
    # keeps (~the model's size in resident memory for the rest of the run, measured); hand them back.
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def materialize_shards(model: nn.Module, host: dict[str, Source], device: torch.device,
                       ranks_per_node: int = 0) -> int:
    """Give every meta parameter of ``model`` this rank's slice of its ``host`` tensor on ``device``.

    The parameter objects stay the same (``swap_tensors``), so ties, FSDP2's references and
    ``requires_grad`` survive; FSDP2 re-reads its sharded parameters at its lazy init (as
    after ``load_state_dict``). Slices are upcast to the parameter's dtype as they are placed.
    Staggered by local rank (:func:`load_turns`). Returns the bytes placed on ``device``.
    """
    at_once = load_turns(ranks_per_node, host)
    deferred = any(not isinstance(src, torch.Tensor) for src in host.values())
    placed = staggered(lambda: _materialize(model, host, device), at_once)
    if deferred:
        _release_freed_host_memory()
    return placed


def _rewrap(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in the tensor subclass that wraps ``p``'s (local) data, if any: torchao's float8 weights
    (actor.fp8_all_gather: FSDP2 all-gathers them through the subclass's hooks) stay that subclass."""
    inner = p._local_tensor if isinstance(p, DTensor) else p.data
    if type(inner) is torch.Tensor or not hasattr(inner, "__tensor_flatten__"):
        return local
    names, ctx = inner.__tensor_flatten__()
    if len(names) != 1:
        raise TypeError(f"cannot place a {type(inner).__name__} parameter (inner tensors {names})")
    return type(inner).__tensor_unflatten__({names[0]: local}, ctx, local.shape, local.stride())


def _materialize(model: nn.Module, host: dict[str, Source], device: torch.device) -> int:
    placed = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        name = _plain_name(name)
        if not p.is_meta:  # a tied alias already filled
            host.pop(name, None)
            continue
        if name not in host:
            raise KeyError(f"no host tensor for meta parameter {name}")
        # Dropped as soon as its shard is placed: host memory holds the model, not model + shards.
        src = host.pop(name)
        piece = local_piece(src, p)
        if not isinstance(src, torch.Tensor):  # read from the checkpoint here, not checked at load
            _check_finite(piece, name, getattr(p, "_rlhf_where", "checkpoint"))
        local = place(piece, device, p.dtype)
        del piece
        placed += local.numel() * local.element_size()
        local = _rewrap(p, local)
        if isinstance(p, DTensor):
            if local.device.type != p.device_mesh.device_type:
                # CPU offload on a GPU mesh: from_local would move the shard to the GPU, and FSDP2's lazy
                # init then refuses it (the shard stays in host memory, as FSDP2's own offload keeps it)
                local = DTensor(local, p._spec, requires_grad=False)
            else:
                local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
        torch.utils.swap_tensors(p, nn.Parameter(local, requires_grad=p.requires_grad))
    return placed
