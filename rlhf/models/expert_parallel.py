"""Expert parallelism (``parallel.ep``): MoE experts sharded over an ``ep`` group of data-parallel ranks.

Layout (torchtitan's): the data-parallel ranks are split as ``dp = efsdp x ep``; the mesh is
``(pp, efsdp, ep, tp)`` with ``(efsdp, ep)`` flattened back into ``dp`` for everything else.
A rank of the ``ep`` group holds ``num_experts / ep`` whole experts (``mlp.experts.gate_up_proj`` /
``down_proj`` ``Shard(0)`` over ``ep``; with ``tp > 1`` split once more over ``tp``,
``[Shard(0), Shard(0)]`` on ``(ep, tp)``); FSDP2 shards each expert shard over the remaining
``efsdp`` ranks. Attention, router and dense layers keep the dp / tp layout.

Forward of one sparse layer on ``M`` local tokens with top-k routes (``e = top_i``, ``w = top_w``)::

    counts[r, j]   assignments of mine to expert j of ep rank r         [ep, E/ep]   (all-to-all #1)
    x_send         token rows sorted by expert (so by owner rank)       [M k, H]
    x_recv         rows sent to me, by (source rank, local expert)      [R, H]       (all-to-all #2)
    y_recv         my experts on them: one grouped matmul (rlhf.models.moe.experts, k = 1)
    y_send         back to their source ranks                           [M k, H]     (all-to-all #3)
    y[m]           = sum_j w[m, j] * y_send[(m, j)]                       (routing weights applied locally)

The all-to-alls are autograd functions (the backward is the reverse all-to-all), so token,
router and expert gradients are exact. With ``tp > 1`` the tokens are replicated over tp: each tp
rank runs the same all-to-all over its ``ep`` peers at the same tp position, holds ``1/tp`` of the
ep-local experts, and the partial outputs are all-reduced over tp (as :class:`ExpertsOverTP`).

Gradient scale: losses are multiplied by ``dp`` and FSDP2 averages over its mesh. An expert
shard collects the gradients of all ``ep`` peers' tokens through the all-to-all and is then averaged
over ``efsdp = dp / ep`` ranks only, so its gradient would be ``ep`` times too large; the local
weights pass through :func:`scale_grad` by ``1 / ep`` (exact for powers of two). FSDP2's
``set_gradient_divide_factor`` would do the same but needs PREMUL_SUM, which gloo lacks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from rlhf.models.gpt_oss import experts_args
from rlhf.models.moe import experts


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (``send[i]`` rows to rank i, ``recv[i]`` from it); backward = the reverse."""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out = g.new_empty((sum(ctx.send), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
    """Autograd-aware variable-size all-to-all of the rows of ``x [sum(send), ...]`` -> ``[sum(recv), ...]``."""
    return _AllToAll.apply(x, recv, send, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.scale, None


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """Identity in the forward; the gradient multiplied by ``scale`` (module docstring: gradient scale)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def dispatch_counts(top_i: Tensor, num_experts: int, ep: int, group: dist.ProcessGroup
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """All-to-all #1: how many rows go to / come from each ep rank.

    Args:
        top_i: ``[M, k]`` global expert ids of this rank's tokens.
    Returns:
        ``(order, send_counts [ep, E/ep], recv_counts [ep, E/ep])``: ``order`` sorts the ``M k``
        assignments by expert (stable, so by owner rank too); ``recv_counts[r, j]`` rows of ep rank r
        for my local expert j.
    """
    flat = top_i.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    send_counts = torch.bincount(flat, minlength=num_experts).view(ep, num_experts // ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    return order, send_counts, recv_counts


def split_sizes(send_counts: Tensor, recv_counts: Tensor) -> tuple[list[int], list[int]]:
    """The rows this rank sends to / receives from each ep rank (``[ep, E/ep]`` counts summed per rank),
    with one host sync for both."""
    both = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    return both[0], both[1]


def ep_experts(x: Tensor, top_i: Tensor, top_w: Tensor, gate_up: Tensor, down: Tensor, act, *, num_experts: int,
               ep_group: dist.ProcessGroup, tp_mesh: Optional[DeviceMesh] = None, expert_offset: int = 0,
               **expert_kw) -> Tensor:
    """The routed MLP of this rank's tokens with the experts spread over ``ep_group`` (module docstring).

    Args:
        x: ``[M, hidden]`` this rank's tokens; top_i, top_w: ``[M, k]`` global expert ids and weights.
        gate_up: ``[E_local, 2I, hidden]``, down: ``[E_local, hidden, I]``: this rank's experts
            (``E_local = E / (ep x tp)``), already gradient-scaled.
        tp_mesh: the 1-D tp mesh when the ep-local experts are split over tp, else None.
        expert_offset: without ``tp_mesh``, the ep-local index of ``gate_up[0]`` when the caller splits
            the ep-local experts over its own tp group (the rollout's ``rlhf.rollout.expert_dispatch``):
            the result is then this rank's partial sum, which the caller all-reduces.
        expert_kw: more arguments of :func:`rlhf.models.moe.experts` (GPT-OSS's biases, interleaving).
    Returns:
        ``[M, hidden]`` in x's dtype.
    """
    from rlhf.models.tensor_parallel import replicated_input

    ep = dist.get_world_size(ep_group)
    m, k = top_i.shape
    order, send_counts, recv_counts = dispatch_counts(top_i, num_experts, ep, ep_group)
    send, recv = split_sizes(send_counts, recv_counts)
    xs = x.index_select(0, order // k)  # [M k, H] grouped by expert, so by owner rank
    xr = all_to_all(xs, recv, send, ep_group)  # [R, H]
    per_rank = num_experts // ep
    local_e = torch.repeat_interleave(torch.arange(per_rank, device=x.device).repeat(ep), recv_counts.reshape(-1),
                                      output_size=xr.shape[0])  # its size known: no second host sync
    ones = torch.ones((xr.shape[0], 1), dtype=x.dtype, device=x.device)
    offset = expert_offset
    if tp_mesh is not None:
        xr = replicated_input(xr, tp_mesh)
        offset = tp_mesh.get_local_rank() * gate_up.shape[0]
    yr = experts(xr, local_e[:, None], ones, gate_up, down, act, expert_offset=offset, **expert_kw)  # [R, H]
    if tp_mesh is not None:
        yr = DTensor.from_local(yr, tp_mesh, [Partial()]).redistribute(tp_mesh, [Replicate()]).to_local()
    ys = all_to_all(yr, send, recv, ep_group)  # [M k, H] in `order`
    y = torch.zeros_like(ys).index_copy(0, order, ys)  # assignment order
    # (an fp32 router's weights promote the sum to fp32, as rlhf.models.moe.experts does)
    return (y.view(m, k, y.shape[-1]) * top_w[..., None]).sum(dim=1).to(x.dtype)  # m may be 0


class ExpertParallel(ParallelStyle):
    """``mlp.experts`` over the ``ep`` mesh (or the 2-D ``(ep, tp)`` mesh): ``gate_up_proj`` / ``down_proj``
    become ``Shard(0)`` DTensors and the module runs :func:`ep_experts`."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                for pname, p in list(mod.named_parameters(recurse=False)):
                    dt = distribute_tensor(p.data, mesh, [Shard(0)] * mesh.ndim, src_data_rank=None)
                    mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        distribute_module(module, device_mesh, partition)
        module.num_experts_global = self.num_experts
        module.forward = _ep_forward.__get__(module)
        return module


def _ep_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    mesh = self.gate_up_proj.device_mesh
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    tp_mesh = mesh["tp"] if mesh.ndim > 1 else None
    scale = 1.0 / ep_mesh.size()
    gate_up = scale_grad(self.gate_up_proj.to_local(), scale)
    down = scale_grad(self.down_proj.to_local(), scale)
    kw = experts_args(self, gate_up, down, lambda t: scale_grad(t, scale))  # GPT-OSS: layout, biases, act
    return ep_experts(hidden_states, top_k_index, top_k_weights, kw.pop("gate_up"), kw.pop("down"), kw.pop("act"),
                      num_experts=self.num_experts_global, ep_group=ep_mesh.get_group(), tp_mesh=tp_mesh, **kw)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The ``mlp.experts`` modules of the decoder blocks (sparse layers only)."""
    from rlhf.models.loading import decoder_layers

    return [layer.mlp.experts for layer in decoder_layers(model) if hasattr(getattr(layer, "mlp", None), "experts")]


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard the experts of ``model`` (a Qwen3-MoE LM or a pipeline stage of one) over ``mesh["ep"]``
    (``mesh["ep", "tp"]`` when tp > 1). Run after :func:`rlhf.models.tensor_parallel.apply_tp`
    with ``experts=False`` and before FSDP2."""
    ep_mesh = mesh["ep", "tp"] if mesh["tp"].size() > 1 else mesh["ep"]
    from rlhf.models.moe_archs import num_experts as _num_experts

    num_experts = _num_experts(model.config)
    for mod in expert_modules(model):
        ExpertParallel(num_experts)._apply(mod, ep_mesh)
