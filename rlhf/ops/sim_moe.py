"""Mixture-of-experts passes in the simulation (``python -m rlhf.simulate``): the data-dependent parts.

Two places of a MoE forward read token values, which fake tensors do not have:

* the routing replay / router metrics (``rlhf.models.router_replay``) take the positions of the real
  tokens once per forward (``nonzero`` of the attention mask): run on the host, as the packed layout is
  (rlhf/ops/sim_packed.py), so the index stays a real tensor of the simulated shape;
* expert parallelism (``rlhf.models.expert_parallel``) sizes its token all-to-alls from the routing
  counts (all-to-all #1). The routes of fake logits are unknown, so :func:`balanced_dispatch` assumes
  the balanced routing a trained router's load-balancing aims at: the ``M k`` assignments of this rank
  spread evenly over the ``E`` experts, and every ep peer sends this rank as many rows as it sends them.
  The counts' all-to-all still runs (counted); the token all-to-alls and the experts' grouped matmuls
  then run for real on fake tensors at those sizes. A skewed routing moves rows between ranks: the
  simulated bytes are the balanced case's, a real rank's can be larger.

The experts' grouped matmuls (``rlhf.models.moe.grouped_linear``) run as :class:`_GroupedShapes`: what
``torch.nn.functional.grouped_mm`` allocates (its output; in the backward the input's and the weights'
gradients), whatever the dtype (torch's meta kernel takes bf16 only, a CPU fp32 run loops over the experts
with the offsets read on the host).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from rlhf.ops.sim_packed import on_host


def balanced_counts(assignments: int, num_experts: int, ep: int) -> torch.Tensor:
    """``[ep, E/ep]`` int64: ``assignments`` rows spread evenly over the experts (the first ones get
    the remainder), as a real host tensor."""
    per, rest = divmod(assignments, num_experts)
    counts = torch.full((num_experts,), per, dtype=torch.int64)
    counts[:rest] += 1
    return counts.view(ep, num_experts // ep)


def balanced_dispatch(top_i: torch.Tensor, num_experts: int, ep: int, group: dist.ProcessGroup):
    """``rlhf.models.expert_parallel.dispatch_counts`` under balanced routing (module docstring): the
    sort runs (fake), the counts are real host tensors, their all-to-all is issued on fake ones."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    order = torch.sort(top_i.reshape(-1), stable=True)[1]
    with unset_fake_temporarily():
        send = balanced_counts(top_i.numel(), num_experts, ep)
        recv = send.clone()
    probe = torch.empty(send.shape, dtype=send.dtype)  # fake: the counts' all-to-all, counted
    dist.all_to_all_single(torch.empty_like(probe), probe, group=group)
    return order, send, recv


class _GroupedShapes(torch.autograd.Function):
    """``grouped_mm(a [S, in], w [G, out, in]^T)``'s allocations: out ``[S, out]``; backward ``da``, ``dw``."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return a.new_empty((a.shape[0], w.shape[1]))

    @staticmethod
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(w)


def _grouped_shapes(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _GroupedShapes.apply(a, w)


@contextmanager
def moe_on_host() -> Iterator[None]:
    """Inside: the routing replay's token positions and the ep dispatch sizes are real host values, the
    grouped matmuls shape-only (module docstring)."""
    from rlhf.models import expert_parallel as ep_mod
    from rlhf.models import moe
    from rlhf.models.router_replay import RouterReplay

    prop = RouterReplay.tokens
    saved = ep_mod.dispatch_counts, ep_mod.split_sizes, moe.grouped_linear
    RouterReplay.tokens = property(prop.fget, on_host(prop.fset))
    ep_mod.dispatch_counts, ep_mod.split_sizes = balanced_dispatch, on_host(ep_mod.split_sizes)
    moe.grouped_linear = _grouped_shapes
    try:
        yield
    finally:
        RouterReplay.tokens = prop
        ep_mod.dispatch_counts, ep_mod.split_sizes, moe.grouped_linear = saved
