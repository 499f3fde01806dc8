"""Routing replay for MoE routers (``actor.router_replay``) and the routing mismatch metric.

A top-k router is a discrete choice: a small change of the logits (bf16 vs fp32, another kernel,
the weights moved by the previous mini-batch) flips which experts a token uses, and the log-prob of
that token jumps. Replay fixes the choice and keeps the weights differentiable::

    p     = softmax_fp32(x W_router^T)                       [M, E]   (live router: gets gradients)
    e     = replayed ids                                     [M, k]   (recorded earlier, int)
    w     = p[e] (/ sum_j p[e_j] when norm_topk_prob)        [M, k]

Modes: ``R2`` replays the ids the trainer's own old-log-prob pass chose (every update forward,
activation recompute included, routes like the policy that produced ``old_log_probs``); ``R3``
replays the rollout's ids (``rlhf.rollout.routes``: the sampler records the experts of every token it
fed, prompt, response and multi-turn observation tokens) in every trainer forward: old and reference
log-probs, the update, its activation recompute. ``none`` with rollout routes compares only.

``moe/routing_mismatch``: the fraction of (token, sparse layer) pairs whose top-k set used by a
trainer forward differs from the recorded one (0 under replay), ``moe/routing_mismatch_live``: the
same for the live router's own choice (what replay corrects: rollout vs trainer when the sampler
recorded the routes, else update vs old-log-prob pass); over the real tokens of the forwards since the
last report (old-log-prob pass and update) of all ranks. Tokens without a recorded route (``-1``: the
last token of a trajectory, which the sampler never fed) route live and are not counted.

Load-balancing loss (``actor.router_aux_loss_coef``; Switch Transformer eqs. 4-6, transformers'
``load_balancing_loss_func``): over the ``T`` (token, sparse layer) pairs of one forward, padding
excluded, ``f_e`` the fraction of top-k assignments to expert ``e`` (the experts used: the replayed ones
under replay) and ``P_e`` the mean router probability of ``e``::

    aux = E * sum_e f_e * P_e              (1 when balanced; gradients through P only)

Routes are kept in the batch layout, ``routes [N, P+R, S, k]`` int16 (``S`` sparse layers), so any
micro-batching reads them back: the tokens a forward sees are the rows' real tokens in row-major
order (padding-free) or every position (padded).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from rlhf.models import deepseek_v3

REPLAY_MODES = ("none", "R2", "R3")
_GATE = re.compile(r"layers\.(\d+)\.(?:_checkpoint_wrapped_module\.)?mlp\.(?:gate|router)$")  # GPT-OSS: router


def replay_route(logits: Tensor, top_k: int, norm_topk_prob: bool, ids: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``(weights [M, k] in logits' dtype, ids used [M, k], live top-k ids [M, k])``; ``ids=None`` routes
    live, and so does a row of ``ids`` that is -1 (no recorded route)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    live = torch.topk(probs, top_k, dim=-1).indices
    top_i = live if ids is None else torch.where(ids >= 0, ids.to(live.dtype), live)
    top_w = probs.gather(1, top_i)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i, live


def aux_sums(logits: Tensor, top_i: Tensor, num_experts: int, weight: Optional[Tensor] = None) -> list[Tensor]:
    """``[assignments per expert [E], router probability sums [E] (differentiable), pairs []]`` of one
    layer's ``logits [M, E]`` and ``top_i [M, k]``; ``weight [M]`` (0 on padding) or None."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w = torch.ones(probs.shape[0], dtype=probs.dtype, device=probs.device) if weight is None else weight.to(probs)
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device).index_add_(
        0, top_i.reshape(-1), w.repeat_interleave(top_i.shape[1]))
    return [counts, (probs * w[:, None]).sum(0), w.sum()]


def aux_loss(sums: list[Tensor]) -> Tensor:
    """The load-balancing loss (module docstring) from :func:`aux_sums` summed over the layers."""
    counts, probs, pairs = sums
    pairs = pairs.clamp(min=1)
    return counts.numel() * ((counts / pairs) * (probs / pairs)).sum()


def routes_differ(a: Tensor, b: Tensor) -> Tensor:
    """``[M]`` bool: the top-k sets of ``a`` and ``b`` (``[M, k]``) differ (order within k ignored)."""
    return (a.sort(dim=-1).values != b.to(a.dtype).sort(dim=-1).values).any(dim=-1)


class RouterReplay:
    """Patches the routers (``mlp.gate``) of a Qwen3-MoE model in place.

    Per forward the caller sets :attr:`tokens` (``[B, L]`` mask of the tokens the forward sees, or
    None for every position), and :attr:`record_into` (a ``[B, L, S, k]`` tensor to fill) and / or
    :attr:`reference` (the recorded ``[B, L, S, k]`` routes of the same rows); :attr:`replay` says
    whether the reference is used or only compared (``moe/routing_mismatch``).
    """

    def __init__(self, model: nn.Module, layers: list[int], top_k: int, norm_topk_prob: bool, mode: str):
        self.slot = {layer: s for s, layer in enumerate(layers)}  # global layer id -> sparse index
        self.top_k, self.norm, self.mode, self.replay = top_k, norm_topk_prob, mode, mode in ("R2", "R3")
        self.tokens = None
        self.record_into: Optional[Tensor] = None
        self.reference: Optional[Tensor] = None
        self.counts: Optional[Tensor] = None  # [3] float64: used != recorded, live != recorded, pairs
        self.pad_mask: Optional[Tensor] = None  # [B, L] of a padded forward (aux loss: padding excluded)
        self.aux: Optional[list[Tensor]] = None  # aux_sums of the forward being collected (collect_aux)
        for name, mod in model.named_modules():
            m = _GATE.search(name)
            if m is not None and int(m.group(1)) in self.slot:
                mod.forward = self._forward(mod, self.slot[int(m.group(1))])

    @property
    def tokens(self) -> Optional[Tensor]:
        return self._tokens

    @tokens.setter
    def tokens(self, mask: Optional[Tensor]) -> None:
        self._tokens = mask
        # the positions once per forward (one host sync, as unpad), not once per layer
        self._index = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)

    def _select(self, t: Tensor) -> Tensor:
        """``[B, L, ...]`` -> the ``[M, ...]`` tokens of this forward."""
        flat = t.reshape(-1, *t.shape[2:])
        return flat if self._index is None else flat.index_select(0, self._index.to(flat.device))

    def _forward(self, gate: nn.Module, s: int):
        sigmoid = deepseek_v3.is_router(gate)  # DeepSeek-V3: replays the ids its biased selection chose

        def forward(hidden_states: Tensor):
            h = hidden_states.reshape(-1, gate.weight.shape[-1])
            ref = None if self.reference is None else self._select(self.reference[:, :, s]).to(h.device)
            if sigmoid:
                logits, w, top_i, live = deepseek_v3.replay_route(gate, h, ref if self.replay else None)
            else:
                logits = F.linear(h, gate.weight, getattr(gate, "bias", None))  # GPT-OSS: a router bias
                w, top_i, live = replay_route(logits, self.top_k, self.norm, ref if self.replay else None)
            if ref is not None:  # [used != recorded, live != recorded, pairs] over the recorded tokens
                known = (ref >= 0).all(dim=-1)
                diff = torch.stack([(routes_differ(top_i, ref) & known).sum(), (routes_differ(live, ref) & known).sum(),
                                    known.sum()]).double()
                self.counts = diff if self.counts is None else self.counts + diff.to(self.counts.device)
            if self.record_into is not None:
                self._store(top_i, s)
            # (in every forward with autograd, collected or not: an activation recompute must save the
            # same tensors as the forward it repeats)
            if self.aux is not None or torch.is_grad_enabled():
                mask = None if self.pad_mask is None else self.pad_mask.reshape(-1).to(h.device)
                add = aux_sums(logits, top_i, logits.shape[-1], mask)
                if self.aux is not None:
                    self.aux = add if not self.aux else [a + b for a, b in zip(self.aux, add)]
            return logits, w, top_i
        return forward

    def _store(self, top_i: Tensor, s: int) -> None:
        out = self.record_into
        ids = top_i.detach().to(out.device, out.dtype)
        if self._index is None:
            out[:, :, s] = ids.view(out.shape[0], out.shape[1], -1)
        else:
            view = out[:, :, s].reshape(-1, ids.shape[1])  # [B L, k] (a copy: out[:, :, s] is strided)
            view.index_copy_(0, self._index.to(out.device), ids)
            out[:, :, s] = view.view(out.shape[0], out.shape[1], -1)

    def collect_aux(self, on: bool) -> Optional[Tensor]:
        """Start (``on``) collecting the load-balancing loss of the next forward, or stop and return it
        (None when nothing was collected). Stopped before the backward, so an activation recompute of
        the routers adds nothing."""
        out = aux_loss(self.aux) if self.aux else None
        self.aux = [] if on else None
        return out

    def begin_pass(self, batch, record: bool) -> bool:
        """Before a forward-only pass over ``batch`` (a ``RolloutBatch``): True when the pass records its
        routes into a new ``batch.routes`` (``record``, unless the batch carries the rollout's routes
        and the mode is not R2); otherwise each chunk replays / compares ``batch.routes``."""
        if self.mode == "R3" and batch.routes is None:
            raise ValueError("actor.router_replay=R3: the batch carries no rollout routes (the rollout engine "
                             "records them for a MoE model when built with record_routes=True)")
        if not record or (batch.routes is not None and self.mode != "R2"):
            return False
        n, length = batch.input_ids.shape
        batch.routes = torch.zeros(n, length, len(self.slot), self.top_k, dtype=torch.int16,
                                   device=batch.input_ids.device)
        return True

    def mismatch(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
        """``{"moe/routing_mismatch": ...}`` over all ranks of ``group`` (a collective), then start over."""
        counts = self.counts.to(device) if self.counts is not None else torch.zeros(3, dtype=torch.float64,
                                                                                     device=device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        self.counts = None
        used, live, pairs = counts.tolist()
        if pairs <= 0:
            return {}
        return {"moe/routing_mismatch": used / pairs, "moe/routing_mismatch_live": live / pairs}


def build_router_replay(model: nn.Module, hf_config, mode: str, sp_group, trainable: bool
                        ) -> Optional[RouterReplay]:
    """Route recording / replay for a MoE policy (``rlhf.models.moe_archs``; None for a dense model, under
    sp, or for a frozen model unless R3, whose reference log-probs replay the rollout's routes too)."""
    from rlhf.models.moe import MoESpec
    from rlhf.models.moe_archs import is_moe

    moe = is_moe(hf_config)
    if mode != "none" and sp_group is not None:
        raise ValueError(f"actor.router_replay={mode} is not supported with parallel.sp > 1; set it to none")
    if not moe or sp_group is not None or not (trainable or mode == "R3"):
        return None
    spec = MoESpec.from_config(hf_config)  # Mixtral has no norm_topk_prob key: it always renormalises
    layers = [i for i, sparse in enumerate(spec.sparse) if sparse]
    return RouterReplay(model, layers, spec.top_k, spec.norm_topk_prob, mode)
