"""Decode attention over the paged KV cache: the kernel seam.

A kernel reads the K/V of each live slot out of the cache's blocks. It has two parts:
``plan(cache, slots, pos, window, dtype)``, computed once per decode step and shared by
every layer, and ``attend(cache, layer, q, plan, p)`` per layer (``p``: the layer's
``rlhf.models.arch.LayerAttn``: softmax scale, sliding window, logit soft-cap, GPT-OSS's sink logits),
with ``q`` the step's
queries as ``[B, Hkv, G, D]`` (the ``G = H / Hkv`` query heads that share a kv head, in HF's
head order) returning ``[B, Hkv, G, D]``. Slot ``b`` attends to its positions ``[0, pos[b]]``.

* ``GatherAttention`` (the reference; any device): one ``index_select`` per layer copies
  the slots' blocks into a contiguous ``[2Hkv, B, W, D]`` window (a memcpy per block: the
  cache keeps heads outside positions so that a gathered head is ``[W, D]`` contiguous);
  in the cache's contiguous mode it reads the slot regions in place instead (views, folded
  once per step). Attention is then two batched matmuls over the ``B * Hkv`` (slot, kv head)
  pairs, ``softmax(q k^T * scale + mask) v``, with the additive mask built once per step and
  the softmax in fp32 (HF's eager order); Gemma 2's soft-capped layers use the same batches.
  At decode shapes (``G`` query rows per kv head) this takes about a quarter less CPU time
  than SDPA's flash kernel, which runs the same small GEMMs block by block
  (docs/benchmarks.md).
  ``GatherAttention(fused=True)`` (the CPU fp32 default where a C compiler is found) runs the
  steps through ``rlhf.rollout.cpu_attention`` instead, slot regions and paged blocks (no gathered
  copy) alike: one pass per (slot, kv head), no batched matmuls (1.2-2.3x less attention time here, ``bench/cpu_attention.py``; Gemma 2's
  soft-capped layers keep the torch ops).
* ``FlashPagedAttention``: flash-attn's block-table path (``flash_attn_with_kvcache(q, k_cache,
  v_cache, cache_seqlens=, block_table=)``) reads the blocks in place, no gather. The
  function is injectable, so a CPU test drives this kernel with a reference implementation
  of flash-attn's calling convention. flash-attn 2 needs blocks of a multiple of 256
  positions (``block_multiple``); the sampler rounds its block size up to it.

* ``FlashPagedAttention(fn=TorchKVCache())``: the same call through torch's own
  ``varlen_attn(block_table=, seqused_k=)`` (FlashAttention-2 bundled with torch >= 2.10; CUDA,
  fp16 / bf16, sm80+; ``rlhf.models.torch_attention``): no flash-attn package needed, and, like
  flash-attn's, nothing read back per step, so it runs under CUDA graphs.

``decode_attention(device, dtype)`` picks by ``rlhf.models.attention_backend`` (flash-attn, then
torch's paged kernel, then the reference).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from rlhf.models import attention_backend
from rlhf.models.gpt_oss import sink_scale
from rlhf.models.softcap_attention import attention as capped_attention
from rlhf.models.softcap_attention import sink_softmax
from rlhf.models.torch_attention import TorchKVCache
from rlhf.rollout import cpu_attention

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
    """Reference decode attention: the window's K/V (slot-region views, else a gathered copy), then
    batched matmuls (see module docstring)."""

    name = "gather"
    block_multiple = 1
    in_place = False  # reads a copy of the window: a contiguous cache layout saves the gather

    def __init__(self, fused: bool = False) -> None:
        # fp32 CPU steps over slot regions through rlhf.rollout.cpu_attention (decode_attention's choice)
        self.fused = fused

    def graph_key(self, window: int, contiguous: bool) -> tuple:
        """What a captured decode step depends on: the window's shapes and the cache mode."""
        return (window, contiguous)

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype) -> "_GatherPlan":
        if cache.contiguous:  # every layer's (slot, kv head) pairs at one stride: folded views, once per step
            kv = cache.regions()[:, :, :slots, :, :window].flatten(2, 3)  # [L, 2, B * Hkv, W, D]
            if cache.prefix_cols:  # aligned mode: window and masks in columns, [0, shift) hidden
                shift = cache.shift[:slots]
                return _GatherPlan(None, kv, pos + shift, window, dtype, first=shift, cache=cache)
            return _GatherPlan(None, kv, pos, window, dtype, cache=cache)
        return _GatherPlan(cache.table[:slots, : cache.blocks_for(window)].reshape(-1), None, pos, window, dtype)

    def attend(self, cache: Any, layer: int, q: Tensor, plan: "_GatherPlan", p: Any) -> Tensor:
        b, hkv, g, d = q.shape
        n, w = b * hkv, plan.window
        if self.fused and p.softcap is None and cpu_attention.supports(q):
            own, first, last = plan.fused_args
            if plan.kv is None:  # paged: the kernel follows the block table (no gathered copy)
                return cpu_attention.paged_decode_attention(q, cache.kv[layer], cache.table, first, last, p.scale,
                                                            p.window, p.sinks)
            k, v = cache.regions()[layer].unbind(0)  # [S, Hkv, T, D]: the kernel takes each slot's region
            return cpu_attention.region_decode_attention(q, k, v, own, first, last, 0, p.scale, p.window, p.sinks)
        if plan.kv is not None:  # batch pairs in (slot, kv head) order
            k, v = plan.kv[layer].unbind(0)  # [N, W, D] views
            q3 = q.reshape(n, g, d)
        else:  # a gathered window keeps heads outside: (kv head, slot) order folds without a copy
            k, v = (t.transpose(0, 1).reshape(n, w, d) for t in cache.gather(layer, plan.blocks, b, w))
            q3 = q.transpose(0, 1).reshape(n, g, d)
        mask = plan.batch_mask(p.window, hkv)  # [N, 1, W]
        if p.softcap is not None:  # Gemma 2: tanh soft-cap of the scores
            out = capped_attention(q3, k, v, mask, scale=p.scale, softcap=p.softcap)
        else:
            scores = torch.baddbmm(mask, q3, k.transpose(1, 2), alpha=p.scale)  # [N, G, W]
            sink = None
            if p.sinks is not None:  # GPT-OSS: the head's sink logit joins each row's softmax
                sink = p.sinks.view(hkv, g)
                sink = sink.expand(b, hkv, g) if plan.kv is not None else sink[:, None].expand(hkv, b, g)
                sink = sink.reshape(n, g, 1)
            probs = sink_softmax(scores, sink)
            out = torch.bmm(probs.to(q.dtype), v)  # [N, G, D]
        return out.view(b, hkv, g, d) if plan.kv is not None else out.view(hkv, b, g, d).transpose(0, 1)


class _GatherPlan:
    """Per-step data of ``GatherAttention``: the K/V views of the slot regions ``kv`` (contiguous
    cache) or the slots' blocks to gather, and additive masks (slot ``b`` sees positions
    ``<= pos[b]``, and with a sliding window ``> pos[b] - window``), built once per step for
    each distinct window the layers use. ``first`` ``[B]``: the aligned cache's first visible column
    of each slot (``pos`` then holds columns too)."""

    def __init__(self, blocks: Optional[Tensor], kv: Optional[Tensor], pos: Tensor, window: int,
                 dtype: torch.dtype, first: Optional[Tensor] = None, cache: Any = None) -> None:
        self.blocks, self.kv, self.pos, self.window, self.dtype = blocks, kv, pos, window, dtype
        self.first = first
        self._masks: dict[Optional[int], Tensor] = {}

    @functools.cached_property
    def fused_args(self) -> tuple[Tensor, Tensor, Tensor]:
        """``[B]`` each slot's prompt source (itself: no shared prompt), first and last visible column: the
        fused kernel's arguments, made once per step."""
        b, dev = self.pos.shape[0], self.pos.device
        first = self.first if self.first is not None else torch.zeros(b, dtype=torch.int64, device=dev)
        return torch.arange(b, device=dev), first, self.pos

    def batch_mask(self, sliding: Optional[int], hkv: int) -> Tensor:
        """``[B * Hkv, 1, W]`` additive mask (0 or -inf, the step's dtype) of each (slot, kv head)
        pair in ``attend``'s batch order."""
        if sliding not in self._masks:
            keys = torch.arange(self.window, device=self.pos.device)
            hidden = keys > self.pos[:, None]  # [B, W]
            if sliding is not None:
                hidden |= keys <= self.pos[:, None] - sliding
            if self.first is not None:
                hidden |= keys < self.first[:, None]
            m = torch.zeros(hidden.shape, dtype=self.dtype, device=self.pos.device).masked_fill_(hidden, float("-inf"))
            b, w = m.shape
            m = m[:, None].expand(b, hkv, w) if self.kv is not None else m.expand(hkv, b, w)
            self._masks[sliding] = m.reshape(b * hkv, 1, w)
        return self._masks[sliding]


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
        self.name = getattr(fn, "name", self.name)  # torch's kernel behind this convention: "torch_varlen_paged"

    def graph_key(self, window: int, contiguous: bool) -> tuple:
        """The window is not an input of this kernel (the whole block table and the lengths are):
        one captured decode step serves every window."""
        return (None, contiguous)

    def plan(self, cache: Any, slots: int, pos: Tensor, window: int, dtype: torch.dtype) -> tuple:
        return cache.table[:slots].to(torch.int32), (pos + 1).to(torch.int32)

    def attend(self, cache: Any, layer: int, q: Tensor, plan: tuple, p: Any) -> Tensor:
        table, lengths = plan
        k, v = cache.paged(layer)  # [NB + 1, BS, Hkv, D] views of the blocks
        b, hkv, g, d = q.shape
        extra: dict[str, Any] = {}  # flash-attn >= 2.6 takes both; passed only when a layer needs them
        if p.window is not None:
            extra["window_size"] = (p.window - 1, 0)
        if p.softcap is not None:
            extra["softcap"] = p.softcap
        if p.sinks is not None:  # GPT-OSS: rescaled by the row's log-sum-exp (rlhf.models.gpt_oss)
            extra["return_softmax_lse"] = True
        out = self.fn(q.reshape(b, 1, hkv * g, d), k, v, cache_seqlens=lengths, block_table=table,
                      softmax_scale=p.scale, causal=True, **extra)  # [B, 1, H, D]
        if p.sinks is not None:
            out, lse = out  # lse [B, H, 1]
            out = (out.view(b, hkv * g, d) * sink_scale(lse.view(b, hkv * g, 1), p.sinks.view(1, -1, 1))).to(q.dtype)
        return out.view(b, hkv, g, d)


def gather_on_cuda_reason(device_type: str, dtype: torch.dtype, flash_available: bool) -> Optional[str]:
    """Why a CUDA run decodes with the gather kernel (None: flash-attn's kernel, or not CUDA); torch's own
    paged kernel, where it applies, is chosen before this is asked (``decode_attention``)."""
    if device_type != "cuda":
        return None
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the rollout runs in {dtype} (flash-attn and torch's varlen_attn take fp16 / bf16)"
    if not flash_available:
        return ("flash-attn is not installed, and torch's paged varlen_attn does not apply here (it needs torch >= "
                "2.10, an sm80+ GPU and no logit soft-cap)")
    return None


_WARNED: set[str] = set()


def decode_attention(device: torch.device, dtype: torch.dtype, *,
                     softcap: bool = False) -> GatherAttention | FlashPagedAttention:
    """The decode kernel for ``device`` / ``dtype`` (``softcap``: the model soft-caps its logits, Gemma 2): the
    ``decode`` site of :func:`rlhf.models.attention_backend.choose`: flash-attn's paged kernel, else torch's
    ``varlen_attn`` over the block table (``TorchKVCache`` behind flash-attn's convention), else the gather
    kernel. A CUDA run left with the gather kernel is told once: its paged decode copies every slot's window
    per layer."""
    device = torch.device(device)
    if device.type == "cpu":
        return GatherAttention(fused=dtype == torch.float32 and cpu_attention.available())
    flash = _flash_with_kvcache()
    backend = attention_backend.choose("decode", attention_backend.probe(device, dtype, flash_attn=flash is not None),
                                       softcap=softcap)
    if backend == "flash_attn":
        return FlashPagedAttention()
    if backend == "torch_varlen":
        return FlashPagedAttention(fn=TorchKVCache())
    reason = gather_on_cuda_reason(device.type, dtype, flash is not None) or "logit soft-cap"
    if device.type == "cuda" and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"rollout decode without flash-attn ({reason}): every decode step gathers each slot's whole "
                      "K/V window per layer ([2 kv_heads, slots, window, head_dim], in the CUDA-graph pool under "
                      "rollout.compile; the planner counts it). Use a bf16 rollout on an sm80+ GPU (torch's paged "
                      "varlen_attn) or flash-attn, or a KV budget of max_num_seqs x max length (slot regions read in "
                      "place)", stacklevel=2)
    return GatherAttention()
