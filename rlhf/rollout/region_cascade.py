"""Shared-prompt decode attention over the aligned slot regions of a GRPO call.

In the aligned contiguous cache (``rlhf.rollout.kv_cache``, ``prefix_cols = Pm``) every prompt
ends at column ``Pm`` and every response starts there. When the live slots are runs of ``n``
consecutive slots, each run the samples of one prefill unit (identical prompt K/V; the state
after admission of a GRPO batch), a decode step splits each query's keys into

* the prompt columns ``[0, Pm)``: read once per run from its first slot, the ``n * G`` query
  rows of the run against them in one matmul per (run, kv head) (Hydragen / FlashInfer's cascade,
  Juravsky et al. 2024, here without a separate softmax: see below);
* the response columns ``[Pm, W)``: the same columns for every slot, read in place as
  ``[B * Hkv, W - Pm, D]`` batches of one stride.

The two score blocks are joined into one ``[B, Hkv, G, W]`` tensor in column order before the
fp32 softmax, so the softmax is the one the gather kernel computes over ``[0, W)`` (the same
columns, the same mask); only the matmuls' summation blocking differs (fp32 rounding). At the
bench's GRPO shape (16 prompts x 8, prompts of 8-24 tokens) a step reads ~2x fewer K/V bytes.

Other steps (live slots not in such runs, after finished samples were compacted; layers with a
sliding window, a soft-cap or sink logits) run the base kernel over the aligned columns.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


class RegionCascadePlan:
    """Per-step data: ``n`` slots per run, ``runs`` runs, the prompt columns ``pm``, the step's
    column window, the response-column mask ``[B * Hkv, 1, W - pm]``, the runs' prompt K/V
    ``[L, 2, runs * Hkv, pm, D]`` with its mask ``[runs * Hkv, 1, pm]``, and the base plan."""

    def __init__(self, base: Any, n: int, runs: int, pm: int, window: int, suffix_mask: Tensor,
                 prefix: tuple[Tensor, Tensor]) -> None:
        self.base, self.n, self.runs, self.pm, self.window = base, n, runs, pm, window
        self.suffix_mask = suffix_mask
        self.prefix_kv, self.prefix_mask = prefix


def uniform_runs(groups: list[int]) -> int:
    """``n`` when ``groups`` (the prefill unit of each live slot) are runs of ``n >= 2`` equal ids,
    else 0."""
    n = 1
    while n < len(groups) and groups[n] == groups[0]:
        n += 1
    if n < 2 or len(groups) % n or groups[0] < 0:
        return 0
    for i in range(0, len(groups), n):
        g = groups[i]
        if g < 0 or groups[i:i + n].count(g) != n or (i + n < len(groups) and groups[i + n] == g):
            return 0
    return n


class RegionCascade:
    """Plans and attends the shared-prompt steps of an aligned cache (module docstring). It keeps the
    runs' prompt K/V across steps: those columns are written only by prefills, which re-align slots."""

    def __init__(self) -> None:
        self._prefix_key: Optional[tuple] = None
        self._prefix: Optional[tuple[Tensor, Tensor]] = None
        self._runs_key: Optional[tuple] = None
        self._n = 0

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype, base: Any) -> Any:
        pm = cache.prefix_cols
        if not pm or window <= pm:
            return base
        key = (cache.version, slots)
        if key != self._runs_key:
            self._runs_key, self._n = key, uniform_runs(cache.group[:slots])
        n = self._n
        if not n:
            return base
        runs, hkv = slots // n, cache.num_kv_heads
        pkey = (cache.version, slots, pm, dtype)
        if pkey != self._prefix_key:  # the leads' prompt columns of every layer, [L, 2, runs * Hkv, pm, D]
            regions = cache.regions()
            kv = regions[:, :, 0:slots:n, :, :pm].flatten(2, 3).contiguous()
            first = cache.shift[0:slots:n]  # hidden prompt columns of each run
            hidden = torch.arange(pm, device=pos.device)[None, :] < first[:, None]
            m = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
            self._prefix = (kv, m[:, None].expand(runs, hkv, pm).reshape(runs * hkv, 1, pm))
            self._prefix_key = pkey
        cols = (pos + cache.shift[:slots])[:, None]  # [B, 1] each slot's current column
        hidden = torch.arange(pm, window, device=pos.device)[None, :] > cols
        m = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
        suffix = m[:, None].expand(slots, hkv, window - pm).reshape(slots * hkv, 1, window - pm)
        return RegionCascadePlan(base, n, runs, pm, window, suffix, self._prefix)

    @staticmethod
    def attend(cache: Any, layer: int, q: Tensor, plan: RegionCascadePlan, p: Any) -> Tensor:
        """``q`` ``[B, Hkv, G, D]`` -> ``[B, Hkv, G, D]`` for a layer without sliding window, soft-cap or sinks."""
        b, hkv, g, d = q.shape
        n, runs, pm, w = plan.n, plan.runs, plan.pm, plan.window
        kp, vp = plan.prefix_kv[layer].unbind(0)  # [runs * Hkv, pm, D]
        kv = cache.regions()[layer, :, :b, :, pm:w].flatten(1, 2)  # [2, B * Hkv, W - pm, D] views
        qr = q.reshape(runs, n, hkv, g, d).transpose(1, 2).reshape(runs * hkv, n * g, d)
        scores = torch.empty((b, hkv, g, w), dtype=q.dtype, device=q.device)
        pre = torch.baddbmm(plan.prefix_mask, qr, kp.transpose(1, 2), alpha=p.scale)  # [runs * Hkv, n * G, pm]
        scores.view(runs, n, hkv, g, w)[..., :pm].copy_(pre.view(runs, hkv, n, g, pm).transpose(1, 2))
        flat = scores.view(b * hkv, g, w)
        flat[..., pm:] = torch.baddbmm(plan.suffix_mask, q.reshape(b * hkv, g, d), kv[0].transpose(1, 2),
                                       alpha=p.scale)
        probs = torch.softmax(flat, dim=-1, dtype=torch.float32).to(q.dtype)  # [B * Hkv, G, W]
        pr = probs.view(runs, n, hkv, g, w)[..., :pm].transpose(1, 2).reshape(runs * hkv, n * g, pm)
        out = torch.bmm(probs[..., pm:], kv[1]).view(runs, n, hkv, g, d)
        out += torch.bmm(pr, vp).view(runs, hkv, n, g, d).transpose(1, 2)
        return out.view(b, hkv, g, d)
