"""Attention over packed (padding-free) sequences, plugged into HF models.

transformers (5.x) lets a model call any function registered in ``AttentionInterface``
under the name stored in ``config._attn_implementation``. Every keyword argument given to
``model(**kwargs)`` travels unchanged through the decoder layers into that function, so
a packed forward passes the sequence boundaries as ``cu_seq_lens_q/k`` and
``max_length_q/k`` (transformers' ``FlashAttentionKwargs`` names). The mask builder
calls the function registered under the same name in ``AttentionMaskInterface``; ours
(:func:`varlen_attention_mask`) returns None whenever the mask would only say "causal",
which is always the case for a packed row: nothing of size ``[total, total]`` is built.

Packed calls (``cu_seq_lens_q`` given), two kinds of back end with the same semantics (causal
inside each sequence, no attention across sequences, GQA, optional sliding window):

* GPU: a kernel with flash-attn's varlen calling convention, the one
  :mod:`rlhf.models.attention_backend` picks: ``flash_attn_varlen_func`` (fp16 / bf16; imported
  once; a build that fails to import logs one warning and falls back), else torch's own
  ``varlen_attn`` (fp16 / bf16, sm80+) or compiled FlexAttention, both behind that convention
  (:mod:`rlhf.models.torch_attention`); or a kernel injected by :func:`use_varlen_kernel` (tests
  drive that code path on CPU with :func:`reference_varlen_attention`). Attention-logit
  soft-capping (Gemma 2's ``softcap``) is passed to flash-attn and flex; the other paths apply it with
  :func:`rlhf.models.softcap_attention.attention` (SDPA has no soft-cap). Attention sinks
  (GPT-OSS's ``s_aux``) have no flash-attn varlen kernel: such rows take the path below on every
  device, the sink as one more key of SDPA (:func:`rlhf.models.softcap_attention.sink_sdpa`:
  exact, and no ``[Tq, Tk]`` scores, so a 5k-token row does not hold GiBs of them per layer).
* Otherwise (CPU; CUDA with none of those kernels): sequences are sorted by length and grouped into
  buckets whose lengths are within ``bucket_ratio`` of the bucket's longest; each bucket is
  gathered into ``[n_b, H, L_b, D]`` (right-padded inside the bucket) and runs one
  ``scaled_dot_product_attention(is_causal=True)``. Right padding is harmless under a
  causal mask (a real query never sees a later pad key), and the pad rows are dropped on
  the way back. Peak attention memory is ``max_b n_b * L_b^2`` per head instead of
  ``total^2``; the gathers are differentiable index ops.

Regular calls (no ``cu_seq_lens_q``: padded batches, KV-cache decoding) behave exactly
like ``sdpa``. The implementation can therefore stay switched on for the whole run,
which matters with activation checkpointing: the backward recomputes blocks after the
forward has returned, and must find the same attention implementation.
Limitation: a packed row passed *without* ``cu_seq_lens_q`` is treated as one sequence.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.models import attention_backend
from rlhf.models.gpt_oss import local
from rlhf.models.softcap_attention import attention as softcap_attention
from rlhf.models.softcap_attention import sink_sdpa
from rlhf.models.torch_attention import FlexVarlen, TorchVarlen

__all__ = [
    "VARLEN_ATTN_IMPLEMENTATION",
    "VarlenPlan",
    "build_varlen_plan",
    "varlen_attention_forward",
    "varlen_attention_mask",
    "register_varlen_attention",
    "enable_varlen_attention",
    "varlen_attention_enabled",
    "flash_attn_available",
    "flash_attn_varlen_kernel",
    "reference_varlen_attention",
    "use_varlen_kernel",
    "varlen_kernel",
]

VARLEN_ATTN_IMPLEMENTATION = "rlhf_varlen"
DEFAULT_BUCKET_RATIO = 0.75


@dataclass
class VarlenPlan:
    """Gather plan for the bucketed SDPA path (built once per packed forward).

    Attributes:
        gather: per bucket, ``[n_b * L_b]`` int64 packed-row indices (row-major over
            ``[n_b, L_b]``; pad slots repeat the sequence's last token).
        shape: per bucket, ``(n_b, L_b)``.
        valid: per bucket, ``[real tokens]`` int64 positions of the real tokens in ``[n_b * L_b]``
            (indices, not a bool mask: selecting with them needs no data-dependent ``nonzero``
            per layer, so the pass also runs on fake tensors in ``rlhf.simulate``).
        inverse: ``[total]`` int64; ``cat(real rows of all buckets)[inverse]`` restores
            packed order.
        cu_seqlens: the boundaries the plan was built from (identity is the cache key).
    """

    gather: list[torch.Tensor]
    shape: list[tuple[int, int]]
    valid: list[torch.Tensor]
    inverse: torch.Tensor
    cu_seqlens: torch.Tensor


def build_varlen_plan(cu_seqlens: torch.Tensor, bucket_ratio: float = DEFAULT_BUCKET_RATIO,
                      device: torch.device | None = None) -> VarlenPlan:
    """Group sequences of similar length into buckets.

    Args:
        cu_seqlens: ``[B+1]`` cumulative lengths (a host copy avoids a device read).
        device: where the plan's index tensors go (default: ``cu_seqlens``'s device).
        bucket_ratio: a sequence joins the current bucket while its length is at least
            ``bucket_ratio * L_b`` (``L_b`` = the bucket's longest). 1.0 gives one bucket
            per distinct length; smaller values mean fewer, more padded buckets.

    Returns:
        A :class:`VarlenPlan`.
    """
    if not 0.0 < bucket_ratio <= 1.0:
        raise ValueError(f"bucket_ratio must be in (0, 1], got {bucket_ratio}")
    device = cu_seqlens.device if device is None else device
    cu = cu_seqlens.to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]  # [B]
    order = torch.argsort(lens, descending=True, stable=True).tolist()
    lens_l = lens.tolist()
    starts_l = cu[:-1].tolist()
    gather, shapes, valid, real_rows = [], [], [], []
    i = 0
    while i < len(order) and lens_l[order[i]] > 0:
        longest = lens_l[order[i]]
        j = i
        while j < len(order) and lens_l[order[j]] > 0 and lens_l[order[j]] >= bucket_ratio * longest:
            j += 1
        members = order[i:j]
        b_starts = torch.tensor([starts_l[m] for m in members], dtype=torch.int64)
        b_lens = torch.tensor([lens_l[m] for m in members], dtype=torch.int64)
        offs = torch.arange(longest, dtype=torch.int64)
        ok = offs[None, :] < b_lens[:, None]  # [n_b, L_b]
        idx = b_starts[:, None] + torch.minimum(offs[None, :], b_lens[:, None] - 1)  # [n_b, L_b]
        gather.append(idx.flatten().to(device))
        valid.append(ok.flatten().nonzero().squeeze(1).to(device))
        shapes.append((len(members), longest))
        real_rows.append(idx[ok])
        i = j
    total = int(cu[-1])
    order_packed = torch.cat(real_rows) if real_rows else torch.zeros(0, dtype=torch.int64)
    inverse = torch.empty(total, dtype=torch.int64)
    inverse[order_packed] = torch.arange(order_packed.numel(), dtype=torch.int64)
    return VarlenPlan(gather=gather, shape=shapes, valid=valid, inverse=inverse.to(device), cu_seqlens=cu_seqlens)


# One-entry cache: every layer of one forward receives the very same cu_seqlens tensor.
_PLAN_CACHE: dict[str, Any] = {"key": None, "version": None, "ratio": None, "plan": None}


def _get_plan(cu_seqlens: torch.Tensor, bucket_ratio: float) -> VarlenPlan:
    c = _PLAN_CACHE
    if c["key"] is cu_seqlens and c["version"] == cu_seqlens._version and c["ratio"] == bucket_ratio:
        return c["plan"]
    plan = build_varlen_plan(cu_seqlens, bucket_ratio)
    c.update(key=cu_seqlens, version=cu_seqlens._version, ratio=bucket_ratio, plan=plan)
    return plan


def _sliding_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``[L, L]`` bool: causal and ``q - k < window`` (transformers' sliding overlay)."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return (k <= q) & (k > q - window)


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The sliding-window mask of a ``length``-token sequence, None where plain causal is the same."""
    return _sliding_mask(length, window, device) if window is not None and length > window else None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
          dropout: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA (``mask`` None) or masked SDPA (bool, True = attend), with GQA; soft-capped
    logits take the explicit path (SDPA has no cap); sinks alone (GPT-OSS) are one more SDPA key."""
    if softcap is None and sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                              enable_gqa=True)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if softcap is None:  # sinks alone: one more key through SDPA, no [Tq, Tk] scores (softcap_attention.sink_sdpa)
        return sink_sdpa(q, k, v, mask, scale=scale, sinks=sinks, dropout=dropout)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return softcap_attention(q, k, v, mask, scale=scale, softcap=softcap, dropout=dropout, sinks=sinks)


def _bucketed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: VarlenPlan,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    H, D = q.shape[0], q.shape[-1]
    outs = []
    for idx, (n_b, l_b), ok in zip(plan.gather, plan.shape, plan.valid):
        qb = q.index_select(1, idx).view(H, n_b, l_b, D).transpose(0, 1)  # [n_b, H, L_b, D]
        kb = k.index_select(1, idx).view(k.shape[0], n_b, l_b, D).transpose(0, 1)
        vb = v.index_select(1, idx).view(v.shape[0], n_b, l_b, v.shape[-1]).transpose(0, 1)
        ob = _sdpa(qb, kb, vb, _window_mask(l_b, sliding_window, q.device), scaling, dropout, softcap, sinks)
        ob = ob.transpose(1, 2).reshape(n_b * l_b, H, ob.shape[-1])  # [n_b*L_b, H, Dv]
        outs.append(ob.index_select(0, ok))
    out = torch.cat(outs, dim=0)[plan.inverse]  # [T, H, Dv]
    return out.unsqueeze(0)


_FLASH: dict[str, Any] = {}  # "fn": flash-attn's varlen kernel, or None, after the one import attempt
_INJECTED: dict[str, Any] = {"fn": None}  # a kernel set by use_varlen_kernel (tests, other back ends)
_LOGGED: set = set()


def _log_once(line: str, *, warning: bool = False) -> None:
    """One line per process and node (local rank 0): every rank imports the same build."""
    if line in _LOGGED or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    _LOGGED.add(line)
    print(f"[rlhf] {'warning: ' if warning else ''}{line}", file=sys.stderr if warning else sys.stdout, flush=True)


def flash_attn_varlen_kernel() -> Callable | None:
    """``flash_attn.flash_attn_varlen_func``, imported once per process; None when flash-attn is
    not installed, or installed but its build does not import (a CUDA / torch ABI mismatch
    shows up as ImportError or OSError): then one warning line, and packed attention uses
    the bucketed SDPA path instead of failing at the first forward."""
    if "fn" not in _FLASH:
        fn = None
        if importlib.util.find_spec("flash_attn") is not None:
            try:
                from flash_attn import flash_attn_varlen_func as fn  # optional GPU dependency
            except (ImportError, OSError, RuntimeError) as e:
                fn = None
                _log_once(f"flash-attn is installed but does not import ({type(e).__name__}: {e}); packed "
                          f"attention uses SDPA. Reinstall it for this torch / CUDA: pip install flash-attn "
                          f"--no-build-isolation", warning=True)
        _FLASH["fn"] = fn
    return _FLASH["fn"]


def flash_attn_available() -> bool:
    """True when flash-attn's varlen kernel imports (see :func:`flash_attn_varlen_kernel`)."""
    return flash_attn_varlen_kernel() is not None


@contextlib.contextmanager
def use_varlen_kernel(fn: Callable) -> Iterator[Callable]:
    """Inside: packed attention calls ``fn`` on every device and dtype, with flash-attn's varlen
    calling convention ``fn(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
    dropout_p=, softmax_scale=, causal=, window_size=)`` on ``[total, heads, head_dim]`` tensors
    (e.g. :func:`reference_varlen_attention`, so CPU tests drive the flash-attn code path)."""
    previous, _INJECTED["fn"] = _INJECTED["fn"], fn
    try:
        yield fn
    finally:
        _INJECTED["fn"] = previous


_KERNELS: dict[str, Any] = {}  # one adapter object per backend (their block-mask / boundary caches live there)


def varlen_kernel(device: torch.device, dtype: torch.dtype | None = None, *, softcap: bool = False,
                  dropout: bool = False) -> Callable | None:
    """The flash-attn-convention kernel packed attention uses for inputs on ``device`` in ``dtype``
    (None: any half precision): an injected one, else the ``packed`` site's choice of
    :func:`rlhf.models.attention_backend.choose` (flash-attn, torch's ``varlen_attn``, compiled flex);
    None = the bucketed SDPA path. ``softcap`` / ``dropout``: the pass needs them (not every kernel has them)."""
    if _INJECTED["fn"] is not None:
        return _INJECTED["fn"]
    if device.type != "cuda":
        return None
    flash = flash_attn_varlen_kernel()
    cap = attention_backend.probe(device, dtype, flash_attn=flash is not None)
    backend = attention_backend.choose("packed", cap, softcap=softcap, dropout=dropout)
    if backend == "flash_attn":
        fn = flash
    elif backend == "torch_varlen":
        fn = _KERNELS.setdefault(backend, TorchVarlen())
    elif backend == "flex":
        fn = _KERNELS.setdefault(backend, FlexVarlen())
    else:
        fn = None
    _log_once(f"packed attention: {backend}" + (" (bucketed SDPA)" if fn is None else ""))
    return fn


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` semantics in plain PyTorch, one SDPA per sequence
    (``softcap > 0``: tanh-capped logits, the explicit form of ``rlhf.models.softcap_attention``).

    ``q [total_q, H, D]``, ``k / v [total_k, Hkv, D]`` (``H % Hkv == 0``); sequence ``i`` is rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q and ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of k / v;
    the causal mask is aligned bottom-right as flash-attn's (query ``j`` of ``Lq`` is at key position
    ``Lk - Lq + j``); ``window_size = (left, right)``, -1 = unbounded (with ``causal`` a query sees
    keys ``q - left .. q``). Returns ``[total_q, H, D]``. A reference for tests, not a fast path.
    """
    if dropout_p:
        raise NotImplementedError("reference_varlen_attention: dropout is not supported")
    out = torch.empty_like(q)
    bounds, kbounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    left, right = window_size
    for start, end, kstart, kend in zip(bounds[:-1], bounds[1:], kbounds[:-1], kbounds[1:]):
        L, Lk = end - start, kend - kstart
        if L == 0:
            continue
        dist_ = (torch.arange(L, device=q.device)[:, None] + Lk - L) - torch.arange(Lk, device=q.device)[None, :]
        allowed = torch.ones(L, Lk, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= dist_ >= 0
        if left >= 0:
            allowed &= dist_ <= left
        if right >= 0:
            allowed &= -dist_ <= right
        qs = q[start:end].transpose(0, 1)[None]  # [1, heads, L, D]
        ks, vs = (x[kstart:kend].transpose(0, 1)[None] for x in (k, v))
        if softcap > 0:
            scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
            o = softcap_attention(qs, ks, vs, allowed, scale=scale, softcap=softcap)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=softmax_scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _unpacked_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    kwargs: dict,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """A regular (padded / cached) call: same result as transformers' sdpa (or, soft-capped / with sinks, eager)."""
    if attention_mask is None and query.shape[2] == key.shape[2]:
        # :func:`varlen_attention_mask` dropped a plain causal (or sliding) mask.
        mask = _window_mask(query.shape[2], sliding_window, query.device)
        return _sdpa(query, key, value, mask, scaling, dropout, softcap, sinks).transpose(1, 2).contiguous(), None
    if softcap is not None or sinks is not None:
        mask = attention_mask
        if mask is not None:  # sdpa_mask's [B, 1, q, kv] (bool, or additive float)
            mask = mask[..., : key.shape[-2]]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if softcap is None:
            out = sink_sdpa(query, key, value, mask, scale=scale, sinks=sinks, dropout=dropout)
        else:
            out = softcap_attention(query, key, value, mask, scale=scale, softcap=softcap, dropout=dropout,
                                    sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
        **kwargs,
    )


def varlen_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry for our implementation.

    Returns None whenever the mask would only encode causality (+ sliding window) - always
    the case for a packed row, whose boundaries travel as ``cu_seq_lens`` - so no
    ``[total, total]`` mask is ever built; a padded or cached call gets sdpa's mask.
    """
    causal_only = (
        not kwargs.get("allow_is_bidirectional_skip", False)
        and q_length == kv_length
        and not kv_offset
        and (attention_mask is None or bool(attention_mask.all()))
    )
    if causal_only:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask, **kwargs
    )


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    varlen_plan: VarlenPlan | None = None,
    varlen_bucket_ratio: float = DEFAULT_BUCKET_RATIO,
    ulysses_group: Any = None,
    prefix_plan: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function for packed sequences.

    Args:
        module: the attention module (unused; part of the interface).
        query: ``[1, H, total, D]``.
        key, value: ``[1, Hkv, total, D]`` (``H % Hkv == 0``, GQA).
        attention_mask: must be None in packed mode (no mask is built for this
            implementation).
        scaling: softmax scale (``D ** -0.5`` when None).
        dropout: attention dropout probability.
        sliding_window: look back at most this many tokens (Mistral / Qwen2 sliding layers).
        cu_seq_lens_q, cu_seq_lens_k: ``[B+1]`` int32 sequence boundaries (must be equal).
        max_length_q, max_length_k: longest sequence (flash-attn needs it).
        varlen_plan: a precomputed :class:`VarlenPlan` for the SDPA path.
        varlen_bucket_ratio: bucketing ratio for the SDPA path.
        ulysses_group: the sp process group when the packed row is split over sequence-
            parallel ranks (:mod:`rlhf.models.ulysses`); q/k/v then hold this rank's tokens.
        prefix_plan: a prefix-grouped row (:mod:`rlhf.models.prefix_grouping`): shared prompts
            once, responses attending to their prompt's keys.

    Returns:
        ``(attn_output [1, total, H, D], None)``.
    """
    sinks = local(kwargs.pop("s_aux", None))  # GPT-OSS's [H] sink logits (this rank's heads under tp)
    softcap = kwargs.pop("softcap", None)
    if sliding_window is None:  # Qwen2-MoE keeps its window on the module only (its sdpa mask carries it)
        sliding_window = getattr(module, "sliding_window", None)
    if prefix_plan is not None:  # the plan knows its attention (no import back from prefix_grouping)
        return prefix_plan.attend(module, query, key, value, scaling, dropout, sliding_window, softcap, sinks), None
    if ulysses_group is not None and cu_seq_lens_q is not None:
        if sinks is not None:
            raise NotImplementedError("attention sinks (GPT-OSS) with sequence parallelism (ulysses, sp > 1) are "
                                      "not supported; set sp to 1")
        from rlhf.models.ulysses import ulysses_attention

        return ulysses_attention(varlen_attention_forward, module, query, key, value, attention_mask, ulysses_group,
                                 scaling=scaling, dropout=dropout, sliding_window=sliding_window, softcap=softcap,
                                 cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_length_q,
                                 max_length_k=max_length_k, varlen_plan=varlen_plan,
                                 varlen_bucket_ratio=varlen_bucket_ratio, **kwargs)
    if cu_seq_lens_q is None:
        return _unpacked_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, kwargs,
                                   softcap, sinks)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1 ([1, H, total, D]); got query {tuple(query.shape)}")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("varlen attention supports self-attention only (cu_seq_lens_k must equal cu_seq_lens_q)")

    # no varlen kernel trains sinks exactly (the LSE's gradient): a GPT-OSS model's packed rows take the
    # bucketed path (sink_sdpa)
    kernel = varlen_kernel(query.device, query.dtype, softcap=softcap is not None,
                           dropout=bool(dropout)) if sinks is None else None
    if kernel is not None:
        max_len = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        cap = {"softcap": softcap} if softcap is not None else {}  # flash-attn >= 2.6
        dv = value.shape[-1]  # DeepSeek's MLA: v narrower than q/k; flash-attn 2 wants one head dim (zero-pad v)
        v = value if dv == query.shape[-1] else torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
        out = kernel(
            query[0].transpose(0, 1),  # [total, H, D]
            key[0].transpose(0, 1),
            v[0].transpose(0, 1),
            cu_seqlens_q=cu_seq_lens_q.to(torch.int32),
            cu_seqlens_k=cu_seq_lens_q.to(torch.int32),
            max_seqlen_q=max_len,
            max_seqlen_k=max_len,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
            window_size=window,
            **cap,
        )
        return out[..., :dv].unsqueeze(0), None

    plan = varlen_plan if varlen_plan is not None else _get_plan(cu_seq_lens_q, varlen_bucket_ratio)
    return _bucketed_sdpa(query, key, value, plan, scaling, dropout, sliding_window, softcap, sinks), None


def register_varlen_attention() -> str:
    """Register :func:`varlen_attention_forward` (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if VARLEN_ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTN_IMPLEMENTATION, varlen_attention_forward)
    if VARLEN_ATTN_IMPLEMENTATION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(VARLEN_ATTN_IMPLEMENTATION, varlen_attention_mask)
    return VARLEN_ATTN_IMPLEMENTATION


def _pretrained_root(model: nn.Module) -> nn.Module:
    """The outermost ``PreTrainedModel`` inside ``model`` (unwraps peft / compile wrappers)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise TypeError(f"{type(model).__name__} contains no transformers PreTrainedModel; cannot set its attention")


def enable_varlen_attention(model: nn.Module) -> str:
    """Switch ``model`` to packed attention; returns the implementation it had before."""
    root = _pretrained_root(model)
    vision = getattr(root.config, "vision_config", None)
    if vision is not None:
        # A vision-language model: only its language model runs packed. The vision tower attends
        # bidirectionally within each image (its own cu_seqlens), which varlen's causal kernel would
        # break; it keeps sdpa and ignores the text's cu_seq_lens it is handed too.
        previous = root.config.text_config._attn_implementation
        if previous != VARLEN_ATTN_IMPLEMENTATION:
            register_varlen_attention()
            root.set_attn_implementation({"text_config": VARLEN_ATTN_IMPLEMENTATION,
                                          "vision_config": vision._attn_implementation or "sdpa"})
        return previous
    previous = root.config._attn_implementation
    if previous != VARLEN_ATTN_IMPLEMENTATION:
        register_varlen_attention()
        root.set_attn_implementation(VARLEN_ATTN_IMPLEMENTATION)
    return previous


@contextlib.contextmanager
def varlen_attention_enabled(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: packed attention inside, the previous implementation after.
    Do not leave it before the backward of a checkpointed forward; prefer
    :func:`enable_varlen_attention` once for training models."""
    previous = enable_varlen_attention(model)
    try:
        yield model
    finally:
        if previous != VARLEN_ATTN_IMPLEMENTATION:
            _pretrained_root(model).set_attn_implementation(previous)
