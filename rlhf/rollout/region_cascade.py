"""Shared-prompt decode attention over the aligned slot regions of a GRPO call.

In the aligned contiguous cache (``rlhf.rollout.kv_cache``, ``prefix_cols = Pm``) every prompt
ends at column ``Pm`` and every response starts there. The live slots of one prefill unit (the
samples of a prompt admitted together: identical prompt K/V) form a group; a decode step splits
each query's keys into

* the prompt columns ``[0, Pm)``: read once per group from its first slot, the ``n * G`` query
  rows of the group (``n``: the largest group, smaller ones padded) against them in one matmul per
  (group, kv head) (Hydragen / FlashInfer's cascade, Juravsky et al. 2024, here without a separate
  softmax: see below). Groups that are runs of ``n`` consecutive slots (a GRPO batch before any
  sample finishes) are folded by views; otherwise the query rows are gathered and scattered back;
* the response columns ``[Pm, W)``: the same columns for every slot, read in place as
  ``[B * Hkv, W - Pm, D]`` batches of one stride.

The two score blocks are joined into one ``[B, Hkv, G, W]`` tensor in column order before the
fp32 softmax, so the softmax is the one the gather kernel computes over ``[0, W)`` (the same
columns, the same mask); only the matmuls' summation blocking differs (fp32 rounding). At the
bench's GRPO shape (16 prompts x 8, prompts of 8-24 tokens) a step reads ~2x fewer K/V bytes.

Steps without a group of two, or where padding would more than double the query rows, and layers
with a sliding window, a soft-cap or sink logits run the base kernel over the aligned columns.

Where the base kernel is the fused CPU kernel (``rlhf.rollout.cpu_attention``), a step's plan is only
each slot's group lead and visible columns (``FusedRegionPlan``): the kernel reads the prompt columns
from the lead's region, so a group's prompt comes from L1 / L2 after its first sample, and it takes
sliding windows and sinks too; the torch-ops plan above (and its copy of the groups' prompts) is not made.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor


# The groups' prompt K/V of every layer is copied once per set of live groups (a contiguous
# [runs * Hkv, pm, D] per layer for the batched matmul) up to this size; above it each layer gathers
# its own at each step.
PREFIX_COPY_BYTES = 64 << 20


class _WithBasePlan:
    """A step plan that carries the base kernel's plan, made on first use (only layers the plan's kernel does
    not take read it)."""

    def __init__(self, base: Callable[[], Any]) -> None:
        self._make_base = base

    @functools.cached_property
    def base(self) -> Any:
        return self._make_base()


class RegionCascadePlan(_WithBasePlan):
    """Per-step data: groups ``[runs, n]`` (``uniform``: runs of consecutive slots; else ``qidx``
    ``[runs * n]`` the slot of each query row, padding rows repeating the group's first slot, and
    ``row_of`` ``[B]`` each slot's row), the prompt columns ``pm``, the step's column window, the
    response-column mask ``[B * Hkv, 1, W - pm]`` (or ``[1, 1, 1]`` zeros), the groups' prompt K/V
    ``[L, 2, runs * Hkv, pm, D]`` (None: gathered per layer) with its mask ``[runs * Hkv, 1, pm]``, and
    the base kernel's plan (made on first use: only layers with a sliding window, soft-cap or sinks
    read it)."""

    def __init__(self, base: Callable[[], Any], layout: "_Groups", pm: int, window: int, suffix_mask: Tensor,
                 prefix: tuple[Optional[Tensor], Tensor]) -> None:
        super().__init__(base)
        self.pm, self.window, self.suffix_mask = pm, window, suffix_mask
        self.n, self.runs, self.uniform = layout.n, layout.runs, layout.uniform
        self.qidx, self.row_of, self.leads = layout.qidx, layout.row_of, layout.leads
        self.prefix_kv, self.prefix_mask = prefix


class FusedRegionPlan(_WithBasePlan):
    """Per-step data of the fused CPU kernel (``rlhf.rollout.cpu_attention``) on an aligned step: each
    slot's group lead ``[B]`` (whose prompt columns ``[0, pm)`` it reads), first and last visible column
    ``[B]``; the base kernel's plan on first use (Gemma 2's soft-capped layers)."""

    def __init__(self, base: Callable[[], Any], lead: Tensor, first: Tensor, last: Tensor, pm: int) -> None:
        super().__init__(base)
        self.lead, self.first, self.last, self.pm = lead, first, last, pm


class _Groups:
    def __init__(self, members: list[list[int]], device: torch.device) -> None:
        self.runs, self.n = len(members), max(len(m) for m in members)
        n = self.n
        self.uniform = all(m == list(range(i * n, (i + 1) * n)) for i, m in enumerate(members))
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        self.leads = t([m[0] for m in members])
        lead_of = [0] * sum(map(len, members))
        for m in members:
            for slot in m:
                lead_of[slot] = m[0]
        self.lead_of = t(lead_of)  # [B] each slot's group lead (the fused kernel's prompt source)
        self.qidx = self.row_of = None
        if not self.uniform:
            self.qidx = t([m[j] if j < len(m) else m[0] for m in members for j in range(n)])
            row_of = [0] * sum(map(len, members))
            for i, m in enumerate(members):
                for j, slot in enumerate(m):
                    row_of[slot] = i * n + j
            self.row_of = t(row_of)


def group_members(groups: list[int]) -> Optional[tuple[list[int], list[list[int]]]]:
    """The prefill units of the live slots (``groups``: the unit of each slot), ascending, and each one's
    slots in slot order; None when no unit has two live slots or padding the groups to the largest would
    more than double the rows."""
    members: dict[int, list[int]] = {}
    for slot, g in enumerate(groups):
        if g < 0:
            return None
        members.setdefault(g, []).append(slot)
    ids = sorted(members)
    out = [members[g] for g in ids]
    n = max(map(len, out), default=0)
    if n < 2 or len(out) * n > 2 * len(groups):
        return None
    return ids, out


class RegionCascade:
    """Plans and attends the shared-prompt steps of an aligned cache (module docstring). It keeps the
    groups' prompt K/V across steps while the same prefill units are live (unit ids are unique in the
    process, ``PagedKVCache.new_units``; a unit's prompt columns are written once, by its prefill)."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._layout: Optional[_Groups] = None
        self._prefix: Optional[tuple[Optional[Tensor], Tensor]] = None
        self._prefix_key: Optional[tuple] = None
        self._zero: Optional[Tensor] = None  # the response mask when no column is hidden

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype,
             base: Callable[[], Any], fused: bool = False) -> Any:
        """A ``RegionCascadePlan`` (``fused``: a ``FusedRegionPlan``, the groups' leads for the fused CPU
        kernel, which needs no copy of the prompts), or ``base()`` (the base kernel's plan) for a step
        without a group."""
        pm = cache.prefix_cols
        if not pm or window <= pm:
            return base()
        key = (cache.version, slots, dtype)
        if key != self._key:
            self._key, self._layout = key, None
            found = group_members(cache.group[:slots])
            if found is not None:
                self._layout = layout = _Groups(found[1], pos.device)
            pkey = None if found is None or fused else (tuple(found[0]), pm, dtype)
            if pkey is not None and pkey != self._prefix_key:
                self._prefix_key = pkey
                # the leads' prompt columns of every layer, [L, 2, runs * Hkv, pm, D], and their hidden columns
                hkv = cache.num_kv_heads
                size = 2 * cache.num_layers * layout.runs * hkv * pm * cache.head_dim * cache.kv.element_size()
                kv = None
                if size <= PREFIX_COPY_BYTES:
                    kv = cache.regions()[:, :, :, :, :pm].index_select(2, layout.leads).flatten(2, 3).contiguous()
                hidden = torch.arange(pm, device=pos.device)[None, :] < cache.shift[layout.leads][:, None]
                m = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
                self._prefix = (kv, m[:, None].expand(layout.runs, hkv, pm).reshape(layout.runs * hkv, 1, pm))
        if self._layout is None:
            return base()
        if fused:
            shift = cache.shift[:slots]
            return FusedRegionPlan(base, self._layout.lead_of, shift, pos + shift, pm)
        hkv = cache.num_kv_heads
        if cache.step_column is not None:  # every slot at the window's last column: no response column hidden
            if self._zero is None or self._zero.dtype != dtype or self._zero.device != pos.device:
                with torch.inference_mode(False):  # kept across steps, some of them outside inference mode
                    self._zero = torch.zeros((1, 1, 1), dtype=dtype, device=pos.device)
            suffix = self._zero
        else:
            cols = (pos + cache.shift[:slots])[:, None]  # [B, 1] each slot's current column
            hidden = torch.arange(pm, window, device=pos.device)[None, :] > cols
            m = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
            suffix = m[:, None].expand(slots, hkv, window - pm).reshape(slots * hkv, 1, window - pm)
        return RegionCascadePlan(base, self._layout, pm, window, suffix, self._prefix)

    @staticmethod
    def attend(cache: Any, layer: int, q: Tensor, plan: RegionCascadePlan, p: Any) -> Tensor:
        """``q`` ``[B, Hkv, G, D]`` -> ``[B, Hkv, G, D]`` for a layer without sliding window, soft-cap or sinks."""
        b, hkv, g, d = q.shape
        n, runs, pm, w = plan.n, plan.runs, plan.pm, plan.window
        if plan.prefix_kv is not None:
            kp, vp = plan.prefix_kv[layer].unbind(0)  # [runs * Hkv, pm, D]
        else:
            kp, vp = cache.regions()[layer, :, :, :, :pm].index_select(1, plan.leads).flatten(1, 2).unbind(0)
        kv = cache.regions()[layer, :, :b, :, pm:w].flatten(1, 2)  # [2, B * Hkv, W - pm, D] views
        rows = q if plan.uniform else q.index_select(0, plan.qidx)  # [runs * n, Hkv, G, D]
        qr = rows.reshape(runs, n, hkv, g, d).transpose(1, 2).reshape(runs * hkv, n * g, d)
        scores = torch.empty((b, hkv, g, w), dtype=q.dtype, device=q.device)
        pre = torch.baddbmm(plan.prefix_mask, qr, kp.transpose(1, 2), alpha=p.scale)  # [runs * Hkv, n * G, pm]
        pre = pre.view(runs, hkv, n, g, pm).transpose(1, 2)  # [runs, n, Hkv, G, pm]
        if plan.uniform:
            scores.view(runs, n, hkv, g, w)[..., :pm].copy_(pre)
        else:
            scores[..., :pm] = pre.reshape(runs * n, hkv, g, pm).index_select(0, plan.row_of)
        flat = scores.view(b * hkv, g, w)
        flat[..., pm:] = torch.baddbmm(plan.suffix_mask, q.reshape(b * hkv, g, d), kv[0].transpose(1, 2),
                                       alpha=p.scale)
        probs = torch.softmax(flat, dim=-1, dtype=torch.float32).to(q.dtype)  # [B * Hkv, G, W]
        pr = probs.view(b, hkv, g, w)[..., :pm]
        if not plan.uniform:
            pr = pr.index_select(0, plan.qidx)
        pr = pr.reshape(runs, n, hkv, g, pm).transpose(1, 2).reshape(runs * hkv, n * g, pm)
        out = torch.bmm(probs[..., pm:], kv[1]).view(b, hkv, g, d)
        o_pre = torch.bmm(pr, vp).view(runs, hkv, n, g, d).transpose(1, 2)  # [runs, n, Hkv, G, D]
        if plan.uniform:
            out.view(runs, n, hkv, g, d).add_(o_pre)
        else:
            out.add_(o_pre.reshape(runs * n, hkv, g, d).index_select(0, plan.row_of))
        return out
