"""One pipeline stage's work in the simulation (``python -m rlhf.simulate`` with ``parallel.pp > 1``).

The real schedules (``torch.distributed.pipelining``) infer stage shapes at their first step by
sending Python objects between the pp ranks (``recv_object_list``), and the rollout reshard's
stage exchange all-gathers each stage's tensor list the same way; a fake process group carries
no objects. So the simulated rank runs what its schedule would run on it, with the same
modules, the same FSDP2 switches and the same buffers, and only the object exchanges are
replaced:

* the stage's receive buffers: torch's ``PipelineStage`` allocates one activation buffer per
  micro-batch on every stage but the first (``_prepare_forward_infra``) and, for a backward,
  one gradient buffer per micro-batch on every stage but the last (``_prepare_backward_infra``);
* the order of forwards and backwards: ``GPipe`` runs every micro-batch's forward, then every
  backward; ``1F1B`` runs ``min(k, stages - stage_index)`` warm-up forwards, then one backward
  and one forward in turn (``Schedule1F1B._step_microbatches``), so stage ``s`` holds the
  activations of that many micro-batches at once. Past the warm-up and the first backward
  every 1F1B step repeats the same allocations and transfers, so only ``warm-up + 2``
  micro-batches run (2 in a forward-only pass) and the last run one's step is counted for
  the micro-batches left out (``LiveBytes.repeated``): the memory peak is reached by then and
  the collective bytes are those of all ``k``;
* FSDP2 inside a stage: every backward but the last keeps the stage's parameters unsharded and
  its gradients unreduced (``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)``: ``backward_maybe_with_nosync``); the last one
  reduce-scatters (``perform_reduce_grad``);
* activations and gradients go to the neighbouring stage with ``isend`` / ``irecv`` (counted as
  ``send`` / ``recv`` bytes);
* the rollout reshard's ``all_gather_object`` of the stages' tensor lists returns, for every
  peer, the list that peer's stage would send (:func:`peer_stage_tensors`).

``Interleaved1F1B`` (several stages per rank) is simulated as its stages run one after another
with ``1F1B``'s warm-up depth per stage, a bound that may differ from the interleaved order.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from rlhf.models.pipeline import PipelineStageModule, split_layers
from rlhf.rollout.reshard import hf_name, rollout_shard_dim, rollout_slice


def in_flight(schedule: str, n_microbatches: int, num_stages: int, stage_index: int) -> int:
    """Micro-batches whose activations stage ``stage_index`` holds at once under ``schedule``."""
    if schedule == "GPipe":
        return n_microbatches
    return min(n_microbatches, num_stages - stage_index)


def peer_stage_tensors(full_model: nn.Module, pp: int, virtual_stages: int, *, dtype: torch.dtype, tp_rank: int,
                       tp_size: int, do_slice: bool) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """Per pp rank: the ``(name, shape, dtype)`` list its rollout reshard sends in the stage exchange
    (``rlhf.rollout.reshard._pp_exchange``), from the whole model on the meta device."""
    num_stages = pp * virtual_stages
    split = split_layers(full_model.config.num_hidden_layers, num_stages)
    out = []
    for rank in range(pp):
        entries = []
        for s in range(rank, num_stages, pp):
            stage = PipelineStageModule(full_model, split[s], stage_index=s, num_stages=num_stages)
            for name, p in stage.named_parameters(remove_duplicate=False):
                name = hf_name(name)
                t = p.detach()
                if do_slice and tp_size > 1 and rollout_shard_dim(name) is not None:
                    t = rollout_slice(t, name, tp_rank, tp_size, full_model.config)
                entries.append((name, tuple(t.shape), dtype))
        out.append(entries)
    return out


@contextmanager
def stage_exchange_from(peers: list[list]) -> Iterator[None]:
    """``dist.all_gather_object`` returns ``peers[j]`` for every other member ``j`` of the group."""
    real = dist.all_gather_object

    def fake(object_list: list, obj, group=None) -> None:
        me = dist.get_rank(group)
        for j in range(len(object_list)):
            object_list[j] = obj if j == me else peers[j]

    dist.all_gather_object = fake
    try:
        yield
    finally:
        dist.all_gather_object = real


def _fsdp_sync(stage: nn.Module, last: bool) -> None:
    if hasattr(stage, "set_requires_gradient_sync"):  # an FSDP2 root (the stage is always one)
        stage.set_is_last_backward(last)
        stage.set_reshard_after_backward(last)
        stage.set_requires_gradient_sync(last)


class StageRunner:
    """This rank's stage(s) of ``pipeline`` (``rlhf.models.pipeline.PipelineModel``) on ``k`` micro-batches
    of ``rows // k`` rows each; ``hidden_dtype``: what travels between stages (bf16 under FSDP2 mixed
    precision)."""

    def __init__(self, pipeline, hidden_size: int, hidden_dtype: torch.dtype, counter=None,
                 tied_numel: int = 0) -> None:
        self.p = pipeline
        self.counter = counter  # rlhf.ops.sim_memory.LiveBytes: categories, and the steps not run
        pipeline.device = torch.device("cpu")  # built for the meta device; the fake tensors live on the host
        self.H = hidden_size
        self.tied_numel = tied_numel  # a middle stage's share of the tied-embedding all-reduce
        self.dtype = hidden_dtype

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.p.pp_group, (self.p.pp_rank + offset) % self.p.pp)

    def _buffers(self, k: int, b: int, L: int) -> list[torch.Tensor]:
        ctx = self.counter.category("pipeline buffers") if self.counter is not None else nullcontext()
        with ctx:
            return [torch.empty(b, L, self.H, dtype=self.dtype) for _ in range(k)]

    def _chunk(self, stage, ids, kwargs, i: int, b: int, recv: list, grad: bool):
        sl = slice(i * b, (i + 1) * b)
        kw = {n: v[sl] for n, v in kwargs.items() if n != "labels" or stage.is_last}
        if stage.is_first:
            x = ids[sl]
        else:
            dist.recv(recv[i], src=self._peer(-1), group=self.p.pp_group)
            x = recv[i].detach().requires_grad_(grad)
        y = stage(x, **kw)
        if not stage.is_last:
            dist.send(y.detach(), dst=self._peer(1), group=self.p.pp_group)
        return x, y

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The pipelined no-grad forward (``PipelineModel.forward``): log-probs [B, L] (or [B, L, 2])
        broadcast from the last stage."""
        k, (B, L) = self.p.n_microbatches, ids.shape
        b = B // k
        _, kwargs = self.p._step_args(ids, mask)
        kwargs["labels"] = ids
        out = None
        shape = (B, L, 2) if self.p.compute_entropy else (B, L)
        run = min(k, 2)
        with torch.no_grad():
            for stage in self.p.stages:
                recv = [] if stage.is_first else self._buffers(k, b, L)
                outs = []
                for i in range(run):
                    with self._repeated(k - run if i == run - 1 else 0):
                        outs.append(self._chunk(stage, ids, kwargs, i, b, recv, False)[1])
                if stage.is_last:  # the schedule's merged output of all k micro-batches
                    out = torch.empty(shape, dtype=torch.float32)
                del recv, outs
        return self.p._broadcast_from_last(out, shape, torch.float32)

    def _repeated(self, times: int):
        return self.counter.repeated(times) if self.counter is not None and times > 0 else nullcontext()

    def forward_backward(self, ids: torch.Tensor, mask: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One pipelined forward-backward (``PipelineModel.forward_backward``) in the schedule's order."""
        k, (B, L) = self.p.n_microbatches, ids.shape
        b = B // k
        _, kwargs = self.p._step_args(ids, mask)
        kwargs["labels"] = ids
        for stage in self.p.stages:
            recv = [] if stage.is_first else self._buffers(k, b, L)
            grads = [] if stage.is_last else self._buffers(k, b, L)
            depth = in_flight(self.p.schedule_name, k, self.p.num_stages, stage.stage_index)
            run = min(k, depth + 2)  # warm-up, then two 1B1F steps: the second one repeats k - run times
            live: dict[int, tuple] = {}

            def fwd(i: int) -> None:
                x, y = self._chunk(stage, ids, kwargs, i, b, recv, True)
                live[i] = (x, loss_fn(y) if stage.is_last else y)

            def bwd(i: int) -> None:
                x, y = live.pop(i)
                _fsdp_sync(stage, i == run - 1)
                if stage.is_last:
                    y.backward()
                else:
                    dist.recv(grads[i], src=self._peer(1), group=self.p.pp_group)
                    y.backward(grads[i])
                if not stage.is_first:
                    dist.send(x.grad, dst=self._peer(-1), group=self.p.pp_group)

            nxt = 0
            for _ in range(depth):
                fwd(nxt)
                nxt += 1
            for i in range(run):
                with self._repeated(k - run if i == 1 and nxt < run else 0):
                    bwd(i)
                    if nxt < run:
                        fwd(nxt)
                        nxt += 1
            del recv, grads, live
        if self.p.tied_across_ranks:
            self._sync_tied_grads()

    def _sync_tied_grads(self) -> None:
        """``PipelineModel._sync_tied_grads`` without its host read of the peers' shape: the fp32 sum
        of the embedding / lm_head gradient shard, all-reduced over pp."""
        mods = [m for s in self.p.stages for m in (s.model.embed_tokens if s.is_first else None,
                                                     s.lm_head if s.is_last else None) if m is not None]
        if mods:
            g = mods[0].weight.grad
            shape = (g.to_local() if hasattr(g, "to_local") else g).shape
        else:  # a middle stage joins the all-reduce with zeros of the end stages' shape
            shape = (self.tied_numel,)
        dist.all_reduce(torch.zeros(shape, dtype=torch.float32), group=self.p.pp_group)

