"""Attention with tanh soft-capping of the logits (Gemma 2), for the trainer and the sampler.

``F.scaled_dot_product_attention`` has no soft-cap, so a capped model runs this explicit form
(transformers' eager attention, same order of operations)::

    s = q k^T * scale;   s = cap * tanh(s / cap);   p = softmax_fp32(s + mask) -> q.dtype;   o = p v

It materialises the ``[.., Tq, Tk]`` scores: memory grows with the square of the length, as in
HF's eager path. On a GPU with flash-attn the trainer's packed path passes ``softcap`` to
``flash_attn_varlen_func`` instead (``rlhf.models.varlen_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, softcap: float,
              dropout: float = 0.0) -> Tensor:
    """Soft-capped attention.

    Args:
        q: ``[..., Hq, Tq, D]``; k, v: ``[..., Hkv, Tk, D]`` with ``Hq % Hkv == 0`` (grouped-query:
            query head ``h`` reads kv head ``h // (Hq / Hkv)``).
        mask: bool (True = attend) or additive float, broadcastable to ``[..., Hq, Tq, Tk]``;
            None attends everywhere.
        scale: softmax scale; softcap: the cap (> 0).
        dropout: attention dropout probability (training only).

    Returns:
        ``[..., Hq, Tq, D]`` in ``q``'s dtype.
    """
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)
