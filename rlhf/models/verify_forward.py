"""Multi-token decode forward over the paged KV cache: ``K + 1`` query tokens per slot in one pass.

The forward of speculative decoding (``rlhf.rollout.speculative``): slot ``b`` feeds its last sampled
token and ``K`` draft tokens at positions ``pos[b, 0..K]``; each one's K/V is written to the cache
and its query attends to the slot's positions ``<= pos[b, j]`` (earlier drafts of the same pass
included), so column ``j``'s logits are those a plain decode step at ``pos[b, j]`` would give after
the tokens before it. Positions beyond what the sampler keeps (rejected drafts) stay in the cache
as junk that the next pass overwrites before any query can see it (the mask stops at a query's
own position).

It is ``decoder.decode`` with ``K + 1`` rows per slot: the ``G = H / Hkv`` query heads sharing a
kv head and the ``K + 1`` columns are folded into ``G * (K + 1)`` query rows of that head, the
layout ``decoder.prefill_chunk`` uses for one prompt. The cache is read through ``cache.view``
(the gather window, or the slot regions in place), not the decode kernel seam.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf.models import arch
from rlhf.models.decoder import DecoderSpec, DecoderWeights, _logits, _mlp, _qkv, _residual_linear


def verify(spec: DecoderSpec, w: DecoderWeights, cache: Any, tokens: Tensor, pos: Tensor, window: int,
           cos: Tensor, sin: Tensor, tp_group: Any = None) -> Tensor:
    """Logits after each of ``K + 1`` tokens per slot of slots ``[0, B)``.

    Args:
        tokens: ``[B, K + 1]`` int64 (a valid id everywhere: columns past a slot's drafts are fed too).
        pos: ``[B, K + 1]`` int64 cache positions, ``pos[b, j] = pos[b, 0] + j`` up to a clamp at the
            rope table's end; ``window`` > ``pos.max()``.
    Returns:
        ``[B, K + 1, V]`` float32 logits.
    """
    b, c = tokens.shape
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = h // hkv
    cs, sn = cos[:, pos, None], sin[:, pos, None]  # [K, B, c, 1, R] per rope table
    slots = torch.arange(b, device=tokens.device)
    index = cache.rows(slots, pos).reshape(-1)  # [B * 2Hkv * c] rows in (slot, head, column) order
    # query row (j, i) of kv head: member j of the group at column i (position pos[b, i])
    masks = arch.Masks(pos.repeat(1, g)[:, None, :], window, tokens.device)  # -> [B, 1, G * c, W]
    x = arch.embed(spec.arch, w.embed, tokens.reshape(-1))  # [B * c, hidden]
    for layer, lw in enumerate(w.layers):
        la = spec.arch.layers[layer]
        qkv = _qkv(spec, lw, x, (b, c), cs[la.rope], sn[la.rope])  # [B, c, Hall, D]
        cache.write(layer, index, qkv[:, :, h:].transpose(1, 2))  # [B, 2Hkv, c, D]
        k, v = cache.view(layer, slots, window)  # [B, Hkv, W, D]
        q = qkv[:, :, :h].reshape(b, c, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * c, d)
        a = arch.attend(q, k, v, masks, la)  # [B, Hkv, G * c, D]
        a = a.view(b, hkv, g, c, d).permute(0, 3, 1, 2, 4).reshape(b * c, h * d)
        x = _residual_linear(x, a, lw.o_w, lw.o_b, tp_group, lw.attn_out_norm, spec.rms_norm_eps)
        x = _mlp(spec, lw, x, tp_group)
    return _logits(spec, w, x).view(b, c, -1)
