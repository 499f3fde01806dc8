"""Routing statistics of the MoE layers, global over ranks: expert load balance and router entropy.

Per sparse layer ``l``, over the real tokens ``t`` of the forwards recorded (padding excluded)::

    c_e                 = #{(t, j): top_i[t, j] = e}                      top-k assignments of expert e
    load_max_mean[l]    = max_e c_e / mean_e c_e         1 = balanced, E / k = all tokens on k experts
    router_entropy[l]   = mean_t  -sum_e p_te log p_te,  p_t = softmax(router logits_t)     (nats; log E = uniform)

Each rank keeps per-layer sums ``[c_0 .. c_{E-1}, sum_t H_t, #tokens]`` (float64) and one all-reduce
adds them. Tensor-parallel ranks route the same tokens, which multiplies every sum of a layer by tp
and leaves both ratios unchanged; pipeline stages contribute zeros for the layers they do not hold.
Activation checkpointing recomputes every block once, which doubles all sums alike. Under Ulysses
sp the up to ``sp - 1`` pad tokens of a packed micro-batch are counted (they are not masked there).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

_GATE = re.compile(r"layers\.(\d+)\.(?:_checkpoint_wrapped_module\.)?mlp\.(?:gate|router)$")  # GPT-OSS: router


def router_sums(logits: Tensor, top_i: Tensor, num_experts: int, mask: Optional[Tensor] = None) -> Tensor:
    """``[E + 2]`` float64: assignment counts per expert, summed router entropy, token count.

    Args:
        logits: ``[M, E]`` router logits; top_i: ``[M, k]`` chosen experts; mask: ``[M]`` bool (None = all real).
    """
    logits = logits.detach().float()
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).double()  # [M]
    # weights, not boolean indexing: no device-to-host sync for the count of real tokens
    w = torch.ones_like(ent) if mask is None else mask.to(ent.dtype)
    counts = torch.bincount(top_i.detach().reshape(-1), weights=w.repeat_interleave(top_i.shape[1]),
                            minlength=num_experts)
    return torch.cat([counts, torch.stack([(ent * w).sum(), w.sum()])])


def summarize(sums: Tensor, layers: list[int]) -> dict[str, float]:
    """Metrics from the reduced ``[L, E + 2]`` sums of :func:`router_sums` (layers with no token skipped)."""
    out: dict[str, float] = {}
    loads, ents = [], []
    for layer, row in zip(layers, sums.tolist()):
        counts, ent, n = row[:-2], row[-2], row[-1]
        if n <= 0:
            continue
        mean = sum(counts) / len(counts)
        load = max(counts) / mean if mean > 0 else 0.0
        out[f"moe/load_max_mean/layer{layer}"] = load
        out[f"moe/router_entropy/layer{layer}"] = ent / n
        loads.append(load)
        ents.append(ent / n)
    if loads:
        out["moe/load_max_mean"] = sum(loads) / len(loads)
        out["moe/router_entropy"] = sum(ents) / len(ents)
    return out


class RouterStats:
    """Forward hooks on the routers (``mlp.gate``) of a Qwen3-MoE model that sum :func:`router_sums` per
    sparse layer while :meth:`record` is active; :meth:`reduce` all-reduces and returns the metrics.

    ``layers``: the global indices of all sparse layers (every rank, every pipeline stage, the same list).
    """

    def __init__(self, model: nn.Module, layers: list[int], num_experts: int) -> None:
        self.layers, self.num_experts = list(layers), num_experts
        self.active, self.mask = False, None
        self.sums: dict[int, Tensor] = {}
        self.handles = []
        for name, mod in model.named_modules():
            m = _GATE.search(name)
            if m is not None and int(m.group(1)) in self.layers:
                self.handles.append(mod.register_forward_hook(self._hook(int(m.group(1)))))

    def _hook(self, layer: int):
        def hook(module: nn.Module, args, output) -> None:
            if not self.active:
                return
            logits, _, top_i = output
            mask = None if self.mask is None else self.mask.reshape(-1).bool()
            s = router_sums(logits, top_i, self.num_experts, mask)
            self.sums[layer] = s if layer not in self.sums else self.sums[layer] + s
        return hook

    @contextmanager
    def record(self) -> Iterator["RouterStats"]:
        self.active = True
        try:
            yield self
        finally:
            self.active, self.mask = False, None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A forward that must not count (a zero-weight pass that keeps collectives in step)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def reduce(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
        """All-reduce the sums over ``group`` (a collective), return the metrics and start over."""
        zero = torch.zeros(self.num_experts + 2, dtype=torch.float64, device=device)
        sums = torch.stack([self.sums.get(layer, zero).to(device) for layer in self.layers])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        self.sums = {}
        return summarize(sums, self.layers)
