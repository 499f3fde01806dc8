"""Decode attention over the paged KV cache: the kernel seam.

A kernel reads the K/V of each live slot out of the cache's blocks. It has two parts:
``plan(cache, slots, pos, window, dtype)``, computed once per decode step and shared by
every layer, and ``attend(cache, layer, q, plan, scale)`` per layer, with ``q`` the step's
queries as ``[B, Hkv, G, D]`` (the ``G = H / Hkv`` query heads that share a kv head, in HF's
head order) returning ``[B, Hkv, G, D]``. Slot ``b`` attends to its positions ``[0, pos[b]]``.

* ``GatherAttention`` (the reference; any device): one ``index_select`` per layer copies
  the slots' blocks into a contiguous ``[2Hkv, B, W, D]`` window (a memcpy per block: the
  cache keeps heads outside positions so that a gathered head is ``[W, D]`` contiguous),
  then SDPA with an additive mask built once per step.
* ``FlashPagedAttention``: flash-attn's block-table path (``flash_attn_with_kvcache(q, k_cache,
  v_cache, cache_seqlens=, block_table=)``) reads the blocks in place, no gather. The
  function is injectable, so a CPU test drives this kernel with a reference implementation
  of flash-attn's calling convention. flash-attn 2 needs blocks of a multiple of 256
  positions (``block_multiple``); the sampler rounds its block size up to it.

``decode_attention(device, dtype)`` picks flash-attn on CUDA with fp16 / bf16 when the
package imports, the reference otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_FLASH: dict[str, Any] = {}


def _flash_with_kvcache() -> Optional[Callable]:
    """flash-attn's ``flash_attn_with_kvcache`` when the package imports (imported once), else None."""
    if "fn" not in _FLASH:
        try:
            from flash_attn import flash_attn_with_kvcache  # optional GPU dependency
        except ImportError:
            flash_attn_with_kvcache = None
        _FLASH["fn"] = flash_attn_with_kvcache
    return _FLASH["fn"]


class GatherAttention:
    """Reference decode attention: gather the window, then SDPA (see module docstring)."""

    name = "gather"
    block_multiple = 1
    in_place = False  # reads a copy of the window: a contiguous cache layout saves the gather

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype) -> tuple:
        n = cache.blocks_for(window)
        blocks = cache.table[:slots, :n].reshape(-1)  # [B * n]
        hidden = torch.arange(window, device=pos.device) > pos[:, None]  # [B, W]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
        return blocks, mask[:, None, None, :], window

    def attend(self, cache: Any, layer: int, q: Tensor, plan: tuple, scale: float) -> Tensor:
        blocks, mask, window = plan
        k, v = cache.window(layer, blocks, q.shape[0], window)  # [B, Hkv, W, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class FlashPagedAttention:
    """flash-attn's paged decode (``flash_attn_with_kvcache`` with ``block_table``).

    Args:
        fn: a function with ``flash_attn_with_kvcache``'s signature (default: flash-attn's own).
    """

    name = "flash_attn_paged"
    block_multiple = 256
    in_place = True  # reads the blocks where they are

    def __init__(self, fn: Optional[Callable] = None) -> None:
        fn = fn or _flash_with_kvcache()
        if fn is None:
            raise ImportError("FlashPagedAttention needs flash-attn: pip install flash-attn --no-build-isolation")
        self.fn = fn

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype) -> tuple:
        return cache.table[:slots].to(torch.int32), (pos + 1).to(torch.int32)

    def attend(self, cache: Any, layer: int, q: Tensor, plan: tuple, scale: float) -> Tensor:
        table, lengths = plan
        k, v = cache.paged(layer)  # [NB + 1, BS, Hkv, D] views of the blocks
        b, hkv, g, d = q.shape
        out = self.fn(q.reshape(b, 1, hkv * g, d), k, v, cache_seqlens=lengths, block_table=table,
                      softmax_scale=scale, causal=True)  # [B, 1, H, D]
        return out.view(b, hkv, g, d)


def decode_attention(device: torch.device, dtype: torch.dtype) -> GatherAttention | FlashPagedAttention:
    """The decode kernel for ``device`` / ``dtype`` (see module docstring)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_with_kvcache() is not None:
        return FlashPagedAttention()
    return GatherAttention()
