"""Multi-token decode forward over the paged KV cache: ``K + 1`` query tokens per slot in one pass.

The forward of speculative decoding (``rlhf.rollout.speculative``): slot ``b`` feeds its last sampled
token and ``K`` draft tokens at positions ``pos[b, 0..K]``; each one's K/V is written to the cache
and its query attends to the slot's positions ``<= pos[b, j]`` (earlier drafts of the same pass
included), so column ``j``'s logits are those a plain decode step at ``pos[b, j]`` would give after
the tokens before it. Positions beyond what the sampler keeps (rejected drafts) stay in the cache
as junk that the next pass overwrites before any query can see it (the mask stops at a query's
own position). Padding columns (past a slot's draft) are neither computed nor written.

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
from rlhf.models.decoder import DecoderSpec, DecoderWeights, _heads_out, _logits, _mlp, _qkv, _residual_linear


def verify(spec: DecoderSpec, w: DecoderWeights, cache: Any, tokens: Tensor, pos: Tensor, valid: Tensor, window: int,
           cos: Tensor, sin: Tensor, tp_group: Any = None) -> Tensor:
    """Logits after each real query token of slots ``[0, B)`` (up to ``K + 1`` per slot).

    Padding-free like ``decoder.prefill``: projections and MLP run on the real tokens only (a slot
    with a short draft costs its own tokens, not ``K + 1``); attention scatters them into a
    ``[B, Hkv, G * (K + 1), D]`` grid and gathers the output back.

    Args:
        tokens: ``[B, K + 1]`` int64; ``valid`` ``[B, K + 1]`` bool: the real ones (a prefix of each row).
        pos: ``[B, K + 1]`` int64 cache positions, ``pos[b, j] = pos[b, 0] + j``; ``window`` > ``pos[valid].max()``.
    Returns:
        ``[T, V]`` float32 logits of the ``T`` real tokens, in row-major order of ``valid``.
    """
    b, c = tokens.shape
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = h // hkv
    grid_index = valid.reshape(-1).nonzero().squeeze(1)  # [T] row of each real token in the [B * c] grid
    t = grid_index.shape[0]
    real_pos = pos.reshape(-1)[grid_index]
    cs, sn = cos[:, real_pos, None], sin[:, real_pos, None]  # [K, T, 1, R] per rope table
    slots = torch.arange(b, device=tokens.device)
    index = cache.rows(grid_index // c, real_pos[:, None]).reshape(-1)  # [T * 2Hkv] rows, (token, head) order
    # query row (j, i) of a kv head: member j of the group at column i (position pos[b, i])
    masks = arch.Masks(pos.repeat(1, g)[:, None, :], window, tokens.device)  # -> [B, 1, G * c, W]
    x = arch.embed(spec.arch, w.embed, tokens.reshape(-1)[grid_index])  # [T, hidden]
    for layer, lw in enumerate(w.layers):
        la = arch.with_sinks(spec.arch.layers[layer], lw.sinks)
        qkv = _qkv(spec, lw, x, (t,), cs[la.rope], sn[la.rope])  # [T, Hall, D]
        cache.write(layer, index, qkv[:, h:])  # [T, 2Hkv, D]
        k, v = cache.view(layer, slots, window)  # [B, Hkv, W, D]
        q = qkv.new_zeros((b * c, h, d)).index_copy_(0, grid_index, qkv[:, :h])
        q = q.view(b, c, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * c, d)
        a = arch.attend(q, k, v, masks, la)  # [B, Hkv, G * c, D]
        a = _heads_out(spec, a.view(b, hkv, g, c, d).permute(0, 3, 1, 2, 4)).reshape(b * c, -1)
        a = a.index_select(0, grid_index)
        x = _residual_linear(x, a, lw.o_w, lw.o_b, tp_group, lw.attn_out_norm, spec.rms_norm_eps)
        x = _mlp(spec, lw, x, tp_group)
    return _logits(spec, w, x)
