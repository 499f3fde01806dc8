"""Shared-prefix (cascade) decode attention over the paged KV cache.

The samples of a GRPO group that were admitted together share their prompt's full KV blocks
(``PagedKVCache.share``). Today's kernels read those blocks once per sample: ``n`` copies of the
same ``[Hkv, P, D]`` K/V per layer and step. Cascade attention (FlashInfer's cascade, Hydragen,
Juravsky et al. 2024) splits each query's keys into the group's shared prefix ``[0, P)`` and the
sample's own suffix ``[P, pos]``:

* prefix: the ``n * G`` query rows of a group (``G`` query heads per kv head) against the shared
  K/V in one batched matmul per (group, kv head): the prefix K/V is read once per group;
* suffix: each slot's query rows against its own positions, as the reference kernel does;
* merge by log-sum-exp. With unnormalised partials ``m_i = max s``, ``l_i = sum exp(s - m_i)``,
  ``o_i = sum exp(s - m_i) v`` of the two key sets::

      m = max(m_1, m_2);   out = (e^{m_1 - m} o_1 + e^{m_2 - m} o_2) / (e^{m_1 - m} l_1 + e^{m_2 - m} l_2)

  which is ``softmax(s) v`` over the union exactly (in real arithmetic; in floating point to the
  rounding of fp32: the sums are taken in another order).

When it pays (``cascade_pays``): a step runs cascade when some group of ``n >= 2`` live slots shares
``P`` prompt positions with ``(n - 1) * P >= MIN_SAVED`` (the prefix positions it no longer reads
once per sample); otherwise the step runs the base kernel unchanged. A ``generate`` call whose prompts could qualify (``prefers_paged``) pages its cache
(``PagedKVCache`` in contiguous mode keeps one copy of the prompt per slot: nothing to share).
Not with CUDA graphs: the groups are host-side data of each step.

Kernels (the ``plan`` / ``attend`` seam of ``rlhf.rollout.paged_attention``):

* ``CascadeAttention(base)``: torch ops (any device); sliding-window and soft-capped layers too.
* ``CascadeAttention(FlashPagedAttention(), fn=flash_attn_with_kvcache)``: both parts through
  flash-attn with ``return_softmax_lse=True`` (prefix: the group's queries as ``n`` query rows of
  the lead slot's block table, non-causal; suffix: each slot's table from its first own block);
  sliding-window layers run the base flash kernel (its window is relative to the last query row).
  A flash-attn without ``return_softmax_lse`` runs the cascade steps with the torch ops.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from rlhf.models.gpt_oss import sink_scale
from rlhf.rollout import cpu_attention
from rlhf.rollout.paged_attention import FlashPagedAttention, GatherAttention
from rlhf.rollout.region_cascade import FusedRegionPlan, RegionCascade, RegionCascadePlan

# The rule (bench/cascade_attention.py, docs/benchmarks.md, 1-thread CPU): a group of n >= 2 live
# samples sharing P positions runs its prefix once when (n - 1) * P >= 1536: n = 8 from P = 256
# (1.24x the slot-region kernel; 0.90x at P = 128), n = 4 from 512 (1.12x; 0.84x at 256), n = 2 from
# 2048 (0.93x at 1024). Below that the fixed cost of a cascade step (the plan's host lists and index
# tensors, two pairs of matmuls and the merge per layer) exceeds the reads it saves.
MIN_GROUP = 2
MIN_SAVED = 1536


def merge_partials(m1: Tensor, l1: Tensor, o1: Tensor, m2: Tensor, l2: Tensor, o2: Tensor,
                   sink: Optional[Tensor] = None) -> Tensor:
    """Softmax attention over two disjoint key sets from their unnormalised partials.

    Args:
        m1, m2: ``[..., 1]`` fp32 row maxima of the scores (``-inf`` or ``finfo.min``: no visible key there).
        l1, l2: ``[..., 1]`` fp32 ``sum exp(s - m)`` (0 where no key is visible).
        o1, o2: ``[..., D]`` fp32 ``sum exp(s - m) v``.
        sink: ``[..., 1]`` GPT-OSS's sink logit of each row (in the denominator only), or None.
    Returns:
        ``[..., D]`` fp32: ``softmax(s) v`` over the union of the keys (see module docstring).
    """
    m = torch.maximum(m1, m2)  # finite: every query sees at least its own position
    a, b = torch.exp(m1 - m), torch.exp(m2 - m)
    den = a * l1 + b * l2
    if sink is not None:
        den = den + torch.exp(sink.float() - m)
    return (a * o1 + b * o2) / den


def merge_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """The same merge from normalised outputs and their log-sum-exps (flash-attn's
    ``return_softmax_lse``): ``o = sigmoid(lse1 - lse2) o1 + sigmoid(lse2 - lse1) o2``.

    Args:
        o1, o2: ``[..., D]`` attention outputs; lse1, lse2: ``[..., 1]`` fp32.
    Returns:
        ``[..., D]`` fp32.
    """
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse) * o1.float() + torch.exp(lse2 - lse) * o2.float()


def _partial(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalised attention of ``q`` ``[N, R, D]`` over ``k, v`` ``[N, W, D]`` with the additive
    ``mask`` (broadcast to ``[N, R, W]``; None: every key visible): ``(m, l, o)`` as in ``merge_partials``.
    The scores follow the reference kernel's order (``s * scale``, the soft-cap, the mask); the
    elementwise steps run in place on the one ``[N, R, W]`` tensor (no fresh multi-MB buffers)."""
    if p.softcap is not None:
        s = torch.bmm(q, k.transpose(1, 2)).mul_(p.scale).div_(p.softcap).tanh_().mul_(p.softcap)
        if mask is not None:
            s.add_(mask)
    elif mask is None:
        s = torch.bmm(q, k.transpose(1, 2)).mul_(p.scale)
    else:
        s = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=p.scale)  # [N, R, W]
    s = s.float()
    # a row with no visible key (a sliding window before the prefix ends): m = finfo.min, l = 0, o = 0
    m = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(s.dtype).min)
    s.sub_(m).exp_()
    o = torch.bmm(s.to(q.dtype), v).float()  # the reference casts the probabilities to q's dtype too
    return m, s.sum(-1, keepdim=True), o


def cascade_pays(group_sizes: list[int], shared_tokens: list[int], min_group: int = MIN_GROUP,
                 min_saved: int = MIN_SAVED) -> list[bool]:
    """Which groups run their prefix once: ``n >= min_group`` live slots sharing ``P`` positions
    with ``(n - 1) * P >= min_saved``."""
    return [n >= min_group and (n - 1) * t >= min_saved for n, t in zip(group_sizes, shared_tokens)]


class _CascadePlan:
    """Per-step data of a cascade step (see ``CascadeAttention.plan``).

    ``qidx`` ``[Gr * nmax]``: slot of each group's query row (padding rows repeat the group's lead);
    ``pre_blocks`` ``[Gr * nbp]``: the groups' shared blocks (padded with the scratch block);
    ``pre_len`` ``[Gr]``; ``row_of`` ``[B]``: each slot's row in the prefix results (``Gr * nmax``:
    no shared prefix); ``start`` ``[B]``: first own position of each slot; ``suf_blocks``
    ``[B * nbs]``: its blocks from there; ``pos`` ``[B]``."""

    def __init__(self, base: Any, qidx: Tensor, pre_blocks: Tensor, pre_len: Tensor, nmax: int, nbp: int,
                 row_of: Tensor, start: Tensor, suf_blocks: Tensor, nbs: int, pos: Tensor, block_size: int,
                 dtype: torch.dtype) -> None:
        self.base, self.qidx, self.pre_blocks, self.pre_len = base, qidx, pre_blocks, pre_len
        self.nmax, self.nbp, self.row_of, self.start = nmax, nbp, row_of, start
        self.suf_blocks, self.nbs, self.pos, self.bs, self.dtype = suf_blocks, nbs, pos, block_size, dtype
        self.groups = pre_len.shape[0]
        self.uniform = False  # every group shares nbp blocks
        self._masks: dict[tuple[str, Optional[int]], Tensor] = {}

    def _additive(self, hidden: Tensor) -> Tensor:
        return torch.zeros(hidden.shape, dtype=self.dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))

    def prefix_mask(self, sliding: Optional[int], hkv: int, g: int) -> Optional[Tensor]:
        """``[Hkv * Gr, 1 or nmax * G, Pmax]`` additive mask of the prefix scores, (kv head, group)
        order; None when every prefix key is visible (groups of one length, no sliding window)."""
        key = ("pre", sliding)
        if sliding is None and self.uniform:
            return None
        if key not in self._masks:
            keys = torch.arange(self.nbp * self.bs, device=self.pos.device)
            hidden = (keys[None, :] >= self.pre_len[:, None])[:, None, :]  # [Gr, 1, Pmax]
            if sliding is not None:  # per query row: its slot's own window
                qpos = self.pos[self.qidx].view(self.groups, self.nmax, 1)
                hidden = hidden | (keys <= qpos - sliding)  # [Gr, nmax, Pmax]
                hidden = hidden[:, :, None].expand(-1, -1, g, -1).reshape(self.groups, self.nmax * g, -1)
            m = self._additive(hidden)
            self._masks[key] = m[None].expand(hkv, *m.shape).reshape(hkv * self.groups, m.shape[1], m.shape[2])
        return self._masks[key]

    def suffix_mask(self, sliding: Optional[int], hkv: int) -> Tensor:
        """``[Hkv * B, 1, Wsuf]`` additive mask: suffix key ``j`` is position ``start + j``."""
        key = ("suf", sliding)
        if key not in self._masks:
            absolute = self.start[:, None] + torch.arange(self.nbs * self.bs, device=self.pos.device)  # [B, Ws]
            hidden = absolute > self.pos[:, None]
            if sliding is not None:
                hidden |= absolute <= self.pos[:, None] - sliding
            m = self._additive(hidden)
            b, w = m.shape
            self._masks[key] = m.expand(hkv, b, w).reshape(hkv * b, 1, w)
        return self._masks[key]


class CascadeAttention:
    """Decode kernel: shared-prefix attention once per group, merged with each slot's own suffix
    (module docstring); the base kernel for steps where it does not pay.

    Args:
        base: the kernel of the other steps (default: ``GatherAttention``).
        fn: flash-attn's ``flash_attn_with_kvcache`` (or a function of its signature that takes
            ``return_softmax_lse``): both parts through it; None: torch ops.
        min_group, min_saved: the rule (``cascade_pays``).
    """

    name = "cascade"

    def __init__(self, base: Any = None, fn: Optional[Callable] = None, min_group: int = MIN_GROUP,
                 min_saved: int = MIN_SAVED) -> None:
        self.base = base or GatherAttention()
        self.fn = fn
        self.min_group, self.min_saved = min_group, min_saved
        self.block_multiple = self.base.block_multiple
        self.in_place = self.base.in_place
        self._buffers: dict[str, Tensor] = {}  # CPU gather buffers, reused (see PagedKVCache.gather)
        # slot regions (no paging): a GRPO call aligns its prompts' ends (rlhf.rollout.region_cascade)
        self.aligns = fn is None and not self.in_place
        self._regions = RegionCascade()

    def graph_key(self, window: int, contiguous: bool) -> tuple:
        return self.base.graph_key(window, contiguous)

    def prefers_paged(self, prompt_lens: list[int], n: int, block_size: int, aligned: bool = False) -> bool:
        """Whether a ``generate`` call of these prompts should page its cache (so that the samples
        share their prompt blocks) because some group may run its prefix once. Not where the call's slot
        regions are ``aligned`` and the fused CPU kernel reads them (each sample reads its group's prompt from
        the group's first slot): that beats the paged cascade at every prompt length measured, 1.10-1.41x
        per ``generate`` at n = 8, 16 and prompts 256-2048 (``bench/cascade_attention.py --sampler``)."""
        if aligned and getattr(self.base, "fused", False):
            return False
        return any(cascade_pays([n], [p // block_size * block_size], self.min_group, self.min_saved)[0]
                   for p in prompt_lens)

    # ------------------------------------------------------------------ plan

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype) -> Any:
        if cache.contiguous and cache.prefix_cols:  # the base plan only where a step or layer falls back
            return self._regions.plan(cache, slots, pos, window, dtype,
                                      lambda: self.base.plan(cache, slots, pos, window, dtype),
                                      fused=getattr(self.base, "fused", False))
        base = self.base.plan(cache, slots, pos, window, dtype)
        # the fused CPU kernel reads shared blocks through each member's table row at the cascade's speed or
        # better (0.96-1.51x, bench/cascade_attention.py): no separate prefix pass
        if cache.contiguous or slots < self.min_group or getattr(self.base, "fused", False):
            return base
        groups = self._groups(cache, slots)
        if not groups:
            return base
        bs, dev = cache.block_size, cache.table.device
        nmax = max(len(m) for m, _ in groups)
        nbp = max(c for _, c in groups)
        qidx, pre_blocks, row_of = [], [], [len(groups) * nmax] * slots
        start = [0] * slots
        for gi, (members, count) in enumerate(groups):
            qidx += members + [members[0]] * (nmax - len(members))
            blocks = cache.owned[members[0]][:count]
            pre_blocks += blocks + [cache.scratch] * (nbp - count)
            for i, s in enumerate(members):
                row_of[s] = gi * nmax + i
                start[s] = count * bs
        start_t = torch.tensor(start, dtype=torch.int64, device=dev)
        first = start_t // bs
        nbs = -(-window // bs) - min(start) // bs  # suffix blocks of the longest suffix, at most
        nbs = max(1, min(nbs, max(len(cache.owned[s]) - start[s] // bs for s in range(slots))))
        cols = (first[:, None] + torch.arange(nbs, device=dev)).clamp(max=cache.table.shape[1] - 1)
        suf_blocks = cache.table[:slots].gather(1, cols)  # [B, nbs]
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        plan = _CascadePlan(base, t(qidx), t(pre_blocks), t([c * bs for _, c in groups]), nmax, nbp, t(row_of),
                            start_t, suf_blocks.reshape(-1), nbs, pos, bs, dtype)
        plan.uniform = all(c == nbp for _, c in groups)
        return plan

    def _groups(self, cache: Any, slots: int) -> list[tuple[list[int], int]]:
        """Live slots that hold the same leading blocks (shared prompt blocks: never written again),
        with the number of blocks all members share, for the groups where cascade pays."""
        by_first: dict[int, list[int]] = {}
        owned = cache.owned
        for s in range(slots):
            if owned[s] and cache.refs[owned[s][0]] > 1:
                by_first.setdefault(owned[s][0], []).append(s)
        out = []
        for members in by_first.values():
            if len(members) < self.min_group:
                continue
            lead = owned[members[0]]
            count = len(lead)
            for s in members[1:]:
                mine, c = owned[s], 0
                limit = min(count, len(mine))
                while c < limit and mine[c] == lead[c]:
                    c += 1
                count = c
            # the last block a slot holds may be written this step: never in the shared prefix
            count = min(count, min(len(owned[s]) for s in members) - 1)
            if cascade_pays([len(members)], [count * cache.block_size], self.min_group, self.min_saved)[0]:
                out.append((members, count))
        return out

    # ------------------------------------------------------------------ attend

    def attend(self, cache: Any, layer: int, q: Tensor, plan: Any, p: Any) -> Tensor:
        if isinstance(plan, FusedRegionPlan):
            if p.softcap is None and cpu_attention.supports(q):
                k, v = cache.regions()[layer].unbind(0)
                return cpu_attention.region_decode_attention(q, k, v, plan.lead, plan.first, plan.last, plan.pm,
                                                             p.scale, p.window, p.sinks)
            return self.base.attend(cache, layer, q, plan.base, p)
        if isinstance(plan, RegionCascadePlan):
            if p.window is None and p.softcap is None and p.sinks is None:
                return RegionCascade.attend(cache, layer, q, plan, p)
            return self.base.attend(cache, layer, q, plan.base, p)
        if not isinstance(plan, _CascadePlan):
            return self.base.attend(cache, layer, q, plan, p)
        if self.fn is not None:
            if p.window is not None:  # flash's window is relative to the last query row: not per member
                return self.base.attend(cache, layer, q, plan.base, p)
            return self._attend_flash(cache, layer, q, plan, p)
        return self._attend_torch(cache, layer, q, plan, p)

    def _gather(self, cache: Any, layer: int, blocks: Tensor, rows: int, name: str) -> tuple[Tensor, Tensor]:
        """K and V ``[Hkv * rows, W, D]`` ((kv head, row) order) of ``rows`` runs of blocks ``blocks``."""
        h2, bs, d = 2 * cache.num_kv_heads, cache.block_size, cache.head_dim
        src = cache.kv[layer].view(h2, cache.num_blocks + 1, bs * d)
        if cache.kv.device.type == "cuda":
            kv = src.index_select(1, blocks)
        else:
            size = h2 * blocks.shape[0] * bs * d
            buf = self._buffers.get(name)
            if buf is None or buf.numel() < size or buf.dtype != cache.kv.dtype:
                with torch.inference_mode(False):  # kept across calls, with inference_mode on or off
                    buf = self._buffers[name] = torch.empty(size, dtype=cache.kv.dtype, device=cache.kv.device)
            kv = torch.index_select(src, 1, blocks, out=buf[:size].view(h2, blocks.shape[0], bs * d))
        h = cache.num_kv_heads
        kv = kv.view(2, h * rows, -1, d)  # [2, Hkv * rows, W, D]: (kv head, row) folds without a copy
        return kv[0], kv[1]

    def _attend_torch(self, cache: Any, layer: int, q: Tensor, plan: _CascadePlan, p: Any) -> Tensor:
        b, hkv, g, d = q.shape
        gr, nmax = plan.groups, plan.nmax
        # prefix: each group's n * G query rows against its shared K/V, once
        k, v = self._gather(cache, layer, plan.pre_blocks, gr, "pre")  # [Hkv * Gr, P, D]
        qp = q.index_select(0, plan.qidx).view(gr, nmax, hkv, g, d).permute(2, 0, 1, 3, 4)
        qp = qp.reshape(hkv * gr, nmax * g, d)
        m1, l1, o1 = _partial(qp, k, v, plan.prefix_mask(p.window, hkv, g), p)  # [Hkv * Gr, nmax * G, .]
        # suffix: each slot's own positions
        k, v = self._gather(cache, layer, plan.suf_blocks, b, "suf")  # [Hkv * B, Ws, D]
        qs = q.transpose(0, 1).reshape(hkv * b, g, d)
        m2, l2, o2 = _partial(qs, k, v, plan.suffix_mask(p.window, hkv), p)  # [Hkv * B, G, .]
        # each slot's prefix row (a last row of "no prefix" for slots outside the groups)
        def rows(x: Tensor, fill: float) -> Tensor:
            x = x.view(hkv, gr * nmax, g, x.shape[-1])
            pad = x.new_full((hkv, 1, g, x.shape[-1]), fill)
            return torch.cat((x, pad), 1).index_select(1, plan.row_of).view(hkv * b, g, -1)

        sink = None if p.sinks is None else p.sinks.view(hkv, 1, g, 1).expand(hkv, b, g, 1).reshape(hkv * b, g, 1)
        out = merge_partials(rows(m1, float("-inf")), rows(l1, 0.0), rows(o1, 0.0), m2, l2, o2, sink)
        return out.to(q.dtype).view(hkv, b, g, d).transpose(0, 1)

    def _attend_flash(self, cache: Any, layer: int, q: Tensor, plan: _CascadePlan, p: Any) -> Tensor:
        b, hkv, g, d = q.shape
        gr, nmax = plan.groups, plan.nmax
        k_cache, v_cache = cache.paged(layer)  # [NB + 1, BS, Hkv, D]
        extra: dict[str, Any] = {} if p.softcap is None else {"softcap": p.softcap}
        qp = q.index_select(0, plan.qidx).view(gr, nmax, hkv * g, d)
        o1, lse1 = self.fn(qp, k_cache, v_cache, cache_seqlens=plan.pre_len.to(torch.int32),
                           block_table=plan.pre_blocks.view(gr, plan.nbp).to(torch.int32), softmax_scale=p.scale,
                           causal=False, return_softmax_lse=True, **extra)  # [Gr, nmax, H, D], [Gr, H, nmax]
        lengths = (plan.pos + 1 - plan.start).to(torch.int32)
        o2, lse2 = self.fn(q.reshape(b, 1, hkv * g, d), k_cache, v_cache, cache_seqlens=lengths,
                           block_table=plan.suf_blocks.view(b, plan.nbs).to(torch.int32), softmax_scale=p.scale,
                           causal=True, return_softmax_lse=True, **extra)  # [B, 1, H, D], [B, H, 1]
        h = hkv * g
        o1 = torch.cat((o1.reshape(gr * nmax, h, d), o1.new_zeros(1, h, d))).index_select(0, plan.row_of)
        lse1 = lse1.float().transpose(1, 2).reshape(gr * nmax, h)
        lse1 = torch.cat((lse1, lse1.new_full((1, h), float("-inf")))).index_select(0, plan.row_of)
        out = merge_lse(o1, lse1[..., None], o2.view(b, h, d), lse2.float().view(b, h, 1))
        if p.sinks is not None:  # GPT-OSS: rescaled by the merged rows' log-sum-exp
            out = out * sink_scale(torch.logaddexp(lse1[..., None], lse2.float().view(b, h, 1)), p.sinks.view(1, h, 1))
        return out.to(q.dtype).view(b, hkv, g, d)


def _takes_lse(fn: Callable) -> bool:
    """Whether ``fn`` (flash-attn's ``flash_attn_with_kvcache``) takes ``return_softmax_lse`` (flash-attn >= 2.6)."""
    try:
        return "return_softmax_lse" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def decode_attention(device: torch.device, dtype: torch.dtype, base: Any = None) -> CascadeAttention:
    """The cascade kernel over ``base`` (default: ``paged_attention.decode_attention``'s choice). Over
    flash-attn's paged kernel both parts run through flash-attn when it returns the log-sum-exp, else
    the cascade steps run the torch ops (the other steps stay on flash-attn)."""
    from rlhf.rollout import paged_attention

    base = base or paged_attention.decode_attention(device, dtype)
    fn = base.fn if isinstance(base, FlashPagedAttention) and _takes_lse(base.fn) else None
    return CascadeAttention(base, fn=fn)
