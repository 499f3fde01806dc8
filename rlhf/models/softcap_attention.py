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
