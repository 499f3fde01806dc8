"""Explicit attention for what SDPA cannot express: tanh soft-capping of the logits (Gemma 2) and
attention sinks (GPT-OSS: a learned per-head logit in the softmax denominator), for the trainer and
the sampler.

``F.scaled_dot_product_attention`` has no soft-cap, so a capped model runs this explicit form
(transformers' eager attention, same order of operations)::

    s = q k^T * scale;   s = cap * tanh(s / cap);   p = softmax_fp32(s + mask) -> q.dtype;   o = p v

With sinks the softmax runs over ``[s + mask, sink_h]`` and the sink's column is dropped (HF's GPT-OSS
eager attention): ``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h))``, so the weights of a row sum to
less than one.

It materialises the ``[.., Tq, Tk]`` scores: memory grows with the square of the length, as in
HF's eager path. On a GPU with flash-attn the trainer's packed path passes ``softcap`` to
``flash_attn_varlen_func`` instead (``rlhf.models.varlen_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sink_softmax(scores: Tensor, sink: Tensor | None) -> Tensor:
    """fp32 softmax of ``scores [..., Tk]`` over the last dim. ``sink``: one logit per row (broadcastable to
    ``[..., 1]``, GPT-OSS) that joins each row's softmax and whose column is then dropped."""
    if sink is None:
        return F.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return F.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, softcap: float | None,
              dropout: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """Soft-capped and / or sink attention.

    Args:
        q: ``[..., Hq, Tq, D]``; k, v: ``[..., Hkv, Tk, D]`` with ``Hq % Hkv == 0`` (grouped-query:
            query head ``h`` reads kv head ``h // (Hq / Hkv)``).
        mask: bool (True = attend) or additive float, broadcastable to ``[..., Hq, Tq, Tk]``;
            None attends everywhere.
        scale: softmax scale; softcap: the cap (> 0), or None.
        sinks: ``[Hq]`` per-head sink logits (GPT-OSS), or ``[Hq, Tq]`` per query row (query heads folded
            into rows, as the sampler's chunked prefill does), or None.
        dropout: attention dropout probability (training only).

    Returns:
        ``[..., Hq, Tq, D]`` in ``q``'s dtype.
    """
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    # with sinks: one more column per (head, query row), the head's sink logit
    sink = None if sinks is None else (sinks.reshape(-1, 1) if sinks.dim() == 1 else sinks)[..., None]
    probs = sink_softmax(scores, sink).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


# keeps the widened head dim a multiple of 8, as the fused SDPA kernels want it
_SINK_PAD = 8


def sink_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, sinks: Tensor,
              dropout: float = 0.0) -> Tensor:
    """Sink attention (GPT-OSS) through ``F.scaled_dot_product_attention``: no ``[.., Tq, Tk]`` scores.

    The sink becomes one more key, first in every row, with a zero value: each head is widened by
    ``_SINK_PAD`` columns, q gets a 1 in the first of them and the sink key ``sink_h / scale`` there
    (every other key 0), so ``q' . k_sink * scale = sink_h`` for every query and ``q' . k'_j = q . k_j``.
    Its softmax is then exactly :func:`attention`'s ``[s, sink_h]`` softmax with the sink column
    dropped, and the sink's gradient flows through that key. A causal call (``mask`` None) attends
    lower-right over the ``Tk + 1`` keys (query i: the sink and keys 0..i); a mask gets an
    always-attended first column. Memory: q, k, v widened (k and v per query head) and the mask, never
    the scores; fused SDPA kernels (flash / memory-efficient) take it on CPU and GPU.

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hkv, Tk, D]`` (grouped-query: expanded to ``Hq`` heads, the
            sink being per query head); mask: bool (True = attend) or additive float, broadcastable
            to ``[B, Hq, Tq, Tk]``, or None for causal with ``Tq == Tk``; sinks: ``[Hq]``.

    Returns:
        ``[B, Hq, Tq, D]`` in ``q``'s dtype.
    """
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    D, Dv = q.shape[-1], v.shape[-1]
    lead_q, lead_k = q.shape[:-1], k.shape[:-2]
    q2 = torch.cat((q, q.new_ones(*lead_q, 1), q.new_zeros(*lead_q, _SINK_PAD - 1)), dim=-1)
    sink = sinks.to(torch.promote_types(sinks.dtype, torch.float32)) / scale
    sink = sink.to(k.dtype).view(-1, 1, 1).expand(*lead_k, 1, 1)
    k_sink = torch.cat((k.new_zeros(*lead_k, 1, D), sink, k.new_zeros(*lead_k, 1, _SINK_PAD - 1)), dim=-1)
    k2 = torch.cat((k_sink, torch.cat((k, k.new_zeros(*k.shape[:-1], _SINK_PAD)), dim=-1)), dim=-2)
    # v widened as q and k: the fused kernels (flash on CPU and GPU) want one head dim
    v2 = torch.cat((v.new_zeros(*lead_k, 1, Dv), v), dim=-2)
    v2 = torch.cat((v2, v2.new_zeros(*v2.shape[:-1], D + _SINK_PAD - Dv)), dim=-1)
    if mask is None:  # bottom-right causal over [sink, keys]: a [Tq, Tk + 1] bool, not per head
        tq, tk = q.shape[-2], k2.shape[-2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    else:
        first = torch.ones if mask.dtype == torch.bool else torch.zeros
        mask = torch.cat((first(*mask.shape[:-1], 1, dtype=mask.dtype, device=mask.device), mask), dim=-1)
    out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out[..., :Dv]
