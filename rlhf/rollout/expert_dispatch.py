"""Expert-parallel rollout (``rollout.ep``): the sampler's MoE layers send their tokens to the experts'
owners with the trainer's all-to-all (:func:`rlhf.models.expert_parallel.ep_experts`).

Layout (:class:`rlhf.rollout.reshard.RolloutLayout`): blocks of ``ep`` consecutive rollout replicas
share one set of experts; each replica holds ``E / ep`` whole experts (split once more over its
``rollout.tp`` ranks: block ``ep_rank x tp + tp_rank`` of ``ep x tp``, as the trainer's ``(ep, tp)``
``Shard(0)``), and everything else as before (attention, router, dense layers: whole or split over tp).
A replica still decodes its own prompts; only the routed rows cross replicas, in every sparse layer::

    x [M, H], top-k ids [M, k]  --all-to-all-->  rows for my experts  --grouped matmul-->
                                <--all-to-all--  their outputs        (weighted by the router locally)

With ``rollout.tp > 1`` the rows are replicated over tp, each tp rank exchanges with the ep peers at its
own tp position and runs its ``1 / tp`` of the experts; the decoder's tp all-reduce sums the parts.

Lockstep: an all-to-all needs every ep peer, but the replicas run different numbers of forward passes
(their prompts, lengths, stops and preemptions differ). Each pass therefore starts with a one-element
``MAX`` all-reduce of "I am running a pass" over the ep group (at the pass's first sparse layer), and a
replica that has finished (or had no prompts) calls :meth:`RolloutEP.drain`: it keeps joining passes
with no tokens of its own, serving its experts to the peers' rows, until a pass in which no peer is
running. Every peer thus runs the same number of passes and the same collectives in the same order.

Not capturable in a CUDA graph (the all-to-all sizes are read on the host): the sampler decodes eagerly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.models.expert_parallel import ep_experts
from rlhf.models.decoder_weights import expert_weights


class RolloutEP:
    """One sampler's expert-parallel MoE dispatch (module docstring).

    Args:
        group: the rollout ep group (``RolloutLayout.ep_group``).
        num_experts: ``E`` of the model (global expert ids).
        num_sparse: sparse (routed) layers per forward pass.
        device: where the lockstep flag lives (the collective's device).
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, num_sparse: int, device: torch.device) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        self.num_experts, self.num_sparse, self.device = num_experts, num_sparse, device
        self._layer = 0  # sparse layers of the current pass done so far
        self.passes = 0  # passes run (own + served)

    def _flag(self, running: bool) -> bool:
        t = torch.tensor([int(running)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item()) if not running else True

    def experts(self, x: Tensor, top_i: Tensor, top_w: Tensor, gate_up: Tensor, down: Tensor,
                act: Callable[[Tensor, Tensor], Tensor], expert_offset: int = 0, **expert_kw) -> Tensor:
        """:func:`rlhf.models.moe.experts`' contract (``expert_offset``: the tp rank's first expert among the
        replica's ``E / ep``); the result is this rank's part, summed over tp by the caller."""
        if self._layer == 0:
            self._flag(True)
            self.passes += 1
        self._layer = (self._layer + 1) % self.num_sparse
        return ep_experts(x, top_i, top_w, gate_up, down, act, num_experts=self.num_experts, ep_group=self.group,
                          expert_offset=expert_offset, **expert_kw)

    def drain(self, layers: list[Any], act: Callable[[Tensor, Tensor], Tensor], tp_rank: int = 0) -> int:
        """Serve the peers' rows until no peer runs a pass; returns the passes served.

        ``layers``: the decoder's ``LayerWeights`` (sparse ones have ``router_w``); ``tp_rank``: this
        rank's place in its replica's tp group (which of the replica's experts it holds)."""
        if self._layer:
            raise RuntimeError("rollout.ep: drain() called in the middle of a forward pass")
        served = 0
        sparse = [expert_weights(lw) for lw in layers if lw.router_w is not None]  # (gate_up, down, kwargs)
        none = sparse[0][0].new_zeros((0, sparse[0][0].shape[-1])) if sparse else None  # no rows of our own
        ids = torch.zeros((0, 1), dtype=torch.int64, device=none.device) if sparse else None
        while self._flag(False):
            for gate_up, down, kw in sparse:
                ep_experts(none, ids, none[:, :1], gate_up, down, act, num_experts=self.num_experts,
                           ep_group=self.group, expert_offset=tp_rank * gate_up.shape[0], **kw)
            served += 1
        self.passes += served
        return served
