"""torch's own attention kernels behind flash-attn's calling conventions.

The packed, prefix-grouped, decode and cascade paths already call flash-attn through two conventions
(``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``), each with a seam where a function of the same
signature is injected. The adapters here put torch's kernels behind those signatures, so every call site
keeps one code path and ``rlhf.models.attention_backend`` only picks the function:

* :class:`TorchVarlen`: ``flash_attn_varlen_func``'s convention over ``torch.nn.attention.varlen.varlen_attn``
  (torch >= 2.10: FlashAttention-2 bundled with torch; CUDA, fp16 / bf16, sm80+). Causal is
  ``window_size=(-1, 0)``, a causal sliding window ``(left, 0)``; no soft-cap, no dropout. Its backward
  returns no gradient for the LSE, which is why sinks never train through it.
* :class:`TorchKVCache`: ``flash_attn_with_kvcache``'s paged convention over the same ``varlen_attn`` with
  ``block_table`` + ``seqused_k`` (inference only), with ``return_softmax_lse`` for the cascade's merge and
  GPT-OSS's sinks. ``max_k`` is the block table's capacity, a constant, so nothing is read back from the
  device and a captured CUDA graph replays for any lengths.
* :class:`FlexVarlen`: ``flash_attn_varlen_func``'s convention over FlexAttention: a document mask built from
  ``cu_seqlens`` (bottom-right causal, sliding window), the soft-cap as a ``score_mod``, GQA. Compiled on CUDA;
  eager (dense scores, forward only) on CPU, which is how tests run it against the reference.

Each adapter takes the kernel function as an argument (default: torch's), so CPU tests drive the adapter with
:func:`reference_torch_varlen_attn` / :func:`reference_flex_attention`: plain-torch readings of the two kernels'
documented semantics (torch 2.13's ``varlen.py`` and ``flex_attention.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TorchVarlen", "TorchKVCache", "FlexVarlen", "reference_torch_varlen_attn", "reference_flex_attention",
           "torch_window"]


def torch_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """flash-attn's ``(causal, window_size)`` as ``varlen_attn``'s one ``window_size``: causal sets the right
    edge to 0 (``(-1, 0)`` is torch's causal; ``(left, 0)`` a causal sliding window of ``left + 1`` keys)."""
    left, right = window_size
    return (left, 0) if causal else (left, right)


class _Lse:
    """``varlen_attn``'s ``return_aux`` (``AuxRequest(lse=True)``) without importing it where torch lacks it."""

    lse = True


def _aux() -> Any:
    try:
        from torch.nn.attention.varlen import AuxRequest
    except ImportError:
        return _Lse()
    return AuxRequest(lse=True)


def _torch_varlen_attn() -> Callable:
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10

    return varlen_attn


class TorchVarlen:
    """``flash_attn_varlen_func(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, dropout_p=,
    softmax_scale=, causal=, window_size=)`` over ``varlen_attn`` (``fn``: its signature; default torch's)."""

    name = "torch_varlen"

    def __init__(self, fn: Optional[Callable] = None) -> None:
        self.fn = fn or _torch_varlen_attn()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                 max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                 causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                 softcap: Optional[float] = None) -> Tensor:
        if dropout_p:
            raise ValueError("torch's varlen_attn has no attention dropout; set the model's attention_dropout to 0 "
                             "or install flash-attn")
        if softcap:
            raise ValueError("torch's varlen_attn has no logit soft-cap (Gemma 2); rlhf.models.attention_backend "
                             "sends such models to flex or SDPA")
        return self.fn(q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
                       int(max_seqlen_k), scale=softmax_scale, window_size=torch_window(causal, window_size),
                       enable_gqa=q.shape[1] != k.shape[1])


class TorchKVCache:
    """``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, block_table=, softmax_scale=, causal=,
    window_size=, return_softmax_lse=)`` on a paged cache over ``varlen_attn(block_table=, seqused_k=)``.

    q ``[B, Sq, H, D]``; caches ``[pages, page_size, Hkv, D]``; ``block_table [B, max_pages]`` int32; returns
    ``[B, Sq, H, D]`` (and the LSE ``[B, H, Sq]`` fp32, flash-attn's layout; ``varlen_attn`` gives ``[H, B * Sq]``).
    """

    name = "torch_varlen_paged"

    def __init__(self, fn: Optional[Callable] = None) -> None:
        self.fn = fn or _torch_varlen_attn()
        self._cu_q: dict[tuple, Tensor] = {}

    def _cu(self, b: int, sq: int, device: torch.device) -> Tensor:
        """The query boundaries ``[0, sq, 2 sq, ...]``, kept per shape for eager steps. Not while a CUDA graph is
        captured: a kernel recorded there runs only at replay, so a tensor made then holds nothing until the first
        replay and must not be reused by an eager step; the capture records its own ``arange``."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        key = (b, sq, device)
        if key not in self._cu_q:
            self._cu_q[key] = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        return self._cu_q[key]

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Tensor, block_table: Tensor,
                 softmax_scale: Optional[float] = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: Optional[float] = None,
                 return_softmax_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if softcap:
            raise ValueError("torch's varlen_attn has no logit soft-cap (Gemma 2): decode such a model with the "
                             "gather kernel (rlhf.models.attention_backend chooses it)")
        b, sq, h, d = q.shape
        used = cache_seqlens.to(torch.int32)
        cu_k = F.pad(used.cumsum(0, dtype=torch.int32), (1, 0))
        max_k = block_table.shape[1] * k_cache.shape[1]
        out = self.fn(q.reshape(b * sq, h, d), k_cache, v_cache, self._cu(b, sq, q.device), cu_k, sq, max_k,
                      scale=softmax_scale, window_size=torch_window(causal, window_size),
                      enable_gqa=h != k_cache.shape[2], seqused_k=used, block_table=block_table,
                      return_aux=_aux() if return_softmax_lse else None)
        if not return_softmax_lse:
            return out.view(b, sq, h, d)
        out, lse = out
        return out.view(b, sq, h, d), lse.view(h, b, sq).permute(1, 0, 2)


def reference_torch_varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                                cu_seq_k: Optional[Tensor], max_q: int, max_k: int, *, return_aux: Any = None,
                                scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                                enable_gqa: bool = False, seqused_k: Optional[Tensor] = None,
                                block_table: Optional[Tensor] = None, num_splits: Optional[int] = None) -> Any:
    """``torch.nn.attention.varlen.varlen_attn`` in plain torch (autograd through it; a test reference).

    Sequence ``i``: queries ``cu_seq_q[i]:cu_seq_q[i+1]``; keys ``cu_seq_k[i]:cu_seq_k[i+1]`` of ``key [Tk, Hkv,
    D]``, or with ``block_table`` the first ``seqused_k[i]`` positions of its pages in ``key [pages, page_size,
    Hkv, D]``. The window is FlashAttention's, aligned bottom-right (query ``j`` of ``Lq`` sits at key position
    ``Lk - Lq + j``): key ``t`` is visible when ``t >= pos - left`` (``left >= 0``) and ``t <= pos + right``
    (``right >= 0``). Returns ``[Tq, H, D]`` and, with ``return_aux.lse``, the LSE ``[H, Tq]`` fp32 (the layout of
    the op's fake kernel; its docstring says ``(T_q, H_q)``).
    """
    del num_splits  # a scheduling choice of the real kernel
    h, hkv = query.shape[1], key.shape[-2]
    if h != hkv and not enable_gqa:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={h} and Hkv={hkv}")
    if block_table is not None and seqused_k is None:
        raise ValueError("block_table requires seqused_k")
    left, right = window_size
    sc = scale if scale is not None else query.shape[-1] ** -0.5
    qb = cu_seq_q.tolist()
    outs, lses = [], []
    for i in range(len(qb) - 1):
        q = query[qb[i]:qb[i + 1]]  # [Lq, H, D]
        if block_table is not None:
            n, ps = int(seqused_k[i]), key.shape[1]
            pages = block_table[i, : -(-n // ps)].long()
            k, v = (x[pages].reshape(-1, hkv, x.shape[-1])[:n] for x in (key, value))
        else:
            ks, ke = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
            n = int(seqused_k[i]) if seqused_k is not None else ke - ks
            k, v = key[ks:ks + n], value[ks:ks + n]
        k, v = (x.repeat_interleave(h // hkv, dim=1) for x in (k, v))  # [Lk, H, D]
        lq = q.shape[0]
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sc
        pos = (torch.arange(lq, device=q.device) + n - lq)[:, None]
        keys = torch.arange(n, device=q.device)[None, :]
        hidden = torch.zeros(lq, n, dtype=torch.bool, device=q.device)
        if left >= 0:
            hidden |= keys < pos - left
        if right >= 0:
            hidden |= keys > pos + right
        s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, -1)  # [H, Lq]
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no visible key: zeros (lse -inf)
        outs.append(torch.einsum("hqk,khd->qhd", p, v.float()).to(query.dtype))
        lses.append(lse)
    out = torch.cat(outs) if outs else query.new_zeros(query.shape)
    if return_aux is not None and return_aux.lse:
        return out, torch.cat(lses, dim=1)
    return out


def _doc_index(cu: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """``[total]`` sequence id and offset inside it of each packed row."""
    lens = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
    return doc, torch.arange(total, device=cu.device) - cu.long()[doc]


class FlexVarlen:
    """``flash_attn_varlen_func``'s convention (soft-cap included) over FlexAttention (``fn``: a function of
    ``flex_attention``'s signature; default torch's, compiled on CUDA)."""

    name = "flex"

    def __init__(self, fn: Optional[Callable] = None) -> None:
        self.fn = fn
        self._mask: dict[str, Any] = {"key": None}

    def _flex(self, device: torch.device) -> Callable:
        if self.fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            # compiled: the fused kernel (eager materialises the [Tq, Tk] scores); dynamic: one graph for every
            # packed length of a run
            self.fn = torch.compile(flex_attention, dynamic=True) if device.type == "cuda" else flex_attention
        return self.fn

    def block_mask(self, cu_q: Tensor, cu_k: Tensor, tq: int, tk: int, causal: bool,
                   window_size: tuple[int, int]) -> Any:
        """The document mask of the packed rows (one per forward: every layer passes the same ``cu`` tensors)."""
        from torch.nn.attention.flex_attention import create_block_mask

        key = (cu_q._version, cu_k._version, tq, tk, causal, tuple(window_size))
        m = self._mask
        if m["key"] == key and m["cu_q"] is cu_q and m["cu_k"] is cu_k:
            return m["mask"]
        q_doc, q_off = _doc_index(cu_q, tq)
        k_doc, k_off = _doc_index(cu_k, tk)
        shift = ((cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])).long()  # bottom-right alignment per sequence
        left, right = window_size
        right = 0 if causal else right

        def mask_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            dist = q_off[qi] + shift[q_doc[qi]] - k_off[ki]  # query position - key position
            ok = q_doc[qi] == k_doc[ki]
            if left >= 0:
                ok = ok & (dist <= left)
            if right >= 0:
                ok = ok & (dist >= -right)
            return ok

        mask = create_block_mask(mask_mod, None, None, tq, tk, device=cu_q.device, _compile=cu_q.is_cuda)
        self._mask.update(key=key, cu_q=cu_q, cu_k=cu_k, mask=mask)
        return mask

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                 max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                 causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                 softcap: Optional[float] = None) -> Tensor:
        if dropout_p:
            raise ValueError("FlexAttention has no attention dropout; set the model's attention_dropout to 0")
        mask = self.block_mask(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal, window_size)
        score_mod = None
        if softcap:
            cap = float(softcap)

            def score_mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
                return torch.tanh(s / cap) * cap

        out = self._flex(q.device)(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   score_mod=score_mod, block_mask=mask, scale=softmax_scale,
                                   enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)


def reference_flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Optional[Callable] = None,
                             block_mask: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
                             **_: Any) -> Tensor:
    """``flex_attention`` with dense scores and autograd (a test reference; CPU flex has no backward):
    ``block_mask.mask_mod`` and ``score_mod`` evaluated on broadcast index grids. ``[B, H, T, D]`` in and out."""
    b, h, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if h != hkv and not enable_gqa:
        raise ValueError("reference_flex_attention: GQA needs enable_gqa=True")
    k, v = (x.repeat_interleave(h // hkv, dim=1) for x in (key, value))
    sc = scale if scale is not None else d ** -0.5
    s = torch.einsum("bhqd,bhkd->bhqk", query, k) * sc
    bi = torch.arange(b)[:, None, None, None]
    hi = torch.arange(h)[None, :, None, None]
    qi = torch.arange(tq, device=query.device)[None, None, :, None]
    ki = torch.arange(tk, device=query.device)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, bi, hi, qi, ki)
    if block_mask is not None:
        s = s.masked_fill(~block_mask.mask_mod(bi, hi, qi, ki), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1).nan_to_num(0.0), v)

