"""Training layout -> rollout layout: gather FSDP2 (and TP) shards into a rollout copy.

Every parameter of the actor is a DTensor sharded over the dp (and tp) mesh dims. The
rollout copy is a plain dict of HF-named tensors replicated over the mesh, produced by
DTensor ``redistribute`` (one all-gather per parameter), in the sampler's dtype. It lives
only for the rollout window: the caller drops it after generation.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate

# Prefixes/infixes that wrappers add to parameter names; rollout wants plain HF names.
_WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module\.|_orig_mod\.|_fsdp_wrapped_module\.)")


def hf_name(name: str) -> str:
    """Strip activation-checkpoint / compile wrapper parts from a parameter name."""
    return _WRAPPER_PARTS.sub("", name)


@dataclass
class ReshardStats:
    seconds: float
    bytes_received: int  # bytes this rank received from others
    numel: int


def gather_full_tensor(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DTensor -> full local tensor via redistribute to Replicate; returns (tensor, bytes received)."""
    if not isinstance(t, DTensor):
        return t.detach(), 0
    local_bytes = t.to_local().numel() * t.element_size()
    full = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()
    return full, full.numel() * full.element_size() - local_bytes


def gather_rollout_weights(model: torch.nn.Module, *, dtype: Optional[torch.dtype] = None,
                           name_filter=None) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """All parameters of `model` as full tensors keyed by HF name (the rollout copy)."""
    t0 = time.perf_counter()
    weights: dict[str, torch.Tensor] = {}
    received = numel = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = hf_name(name)
            if name_filter is not None and not name_filter(name):
                continue
            full, nbytes = gather_full_tensor(p.data if not isinstance(p, DTensor) else p)
            if dtype is not None and full.dtype != dtype:
                full = full.to(dtype)
            weights[name] = full
            received += nbytes
            numel += full.numel()
    return weights, ReshardStats(time.perf_counter() - t0, received, numel)
