"""Batch-invariant forward (``rollout.batch_invariant``): the sampler's log-probs equal the trainer's bit for bit.

A row's result must not depend on which other rows are computed with it. Kernels break that in two ways: a
matmul picks its blocking (and so its summation order) from the row count M (an M=1 decode row takes the gemv
path; a 512-row product another blocking than a 16-row one), and attention over a KV cache sums in another
order than attention over a whole causal row. So every computation here runs on shapes that do not depend on
the batch, and the sampler and the trainer call the same code:

* **Row tiles.** Every row-wise part of a layer (RMSNorm, q|k|v projection, rope, o_proj + residual, the MLP,
  the final norm, the LM head, the log-softmax) runs on tiles of exactly ``ROWS`` rows (the last one padded
  with zero rows): every matmul is ``[ROWS, in] x [in, out]`` whatever the batch, and a row's bits do not
  depend on its place in the tile (``tests/unit/test_batch_invariant.py`` checks both on this machine).
* **Attention by key length.** The query of a token at position ``p`` attends to the ``p + 1`` keys of its
  own sequence: queries with the same ``p`` go into one batched ``softmax(q k^T * scale) v`` over
  contiguous ``[m, Hkv, p + 1, D]`` keys. Each matrix of the batched product has the same shape and
  layout on both sides (a decode step reads them from the KV cache, the trainer from its own sequence), and
  a batched matmul computes each matrix alone.
* **MoE experts.** Each expert's rows of a tile are padded to a tile (no grouped matmul over a varying row
  count), and a token's top-k contributions are summed in top-k order; routing is then the same computation
  on both sides (the router is a row-tiled linear), so the routes match without replay.
* **Rope tables** are built in fixed blocks of positions, so a position's cos / sin do not depend on the
  table length.

The trainer's forward (``invariant_log_probs``) runs the HF module's parameters through this code: each
decoder layer module's ``forward`` is replaced (``install``), so FSDP2 still gathers its parameters around
the call, and the layer's q|k|v and gate|up are concatenated in the autograd graph. Backward runs whatever
kernels autograd picks; only the forward must match.

Scope: the dense Llama-block families and Qwen3-MoE without sliding windows, soft-caps or sinks, on one
tensor-parallel rank; ``check_model`` refuses the rest in one line.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.kl import entropy_from_logits
from rlhf.models import arch, decoder, moe
from rlhf.models.decoder import DecoderSpec, DecoderWeights, LayerWeights
from rlhf.models.decoder_weights import layer_weights

# Rows per tile: every row-wise matmul of the mode is [ROWS, in] x [in, out] (never the M = 1 gemv path). Any
# fixed count keeps a row's bits (tests/unit/test_batch_invariant.py); 64 keeps the trainer's tile loop short
# (a 1.5k-token micro-batch: 24 tiles per layer) and costs a decode step of few live slots little: its
# matmuls read the same weights whether they carry 1 or 64 rows.
ROWS = 64
# Rope table positions per block (each block the same shape, so its cos / sin bits do not depend on the length)
ROPE_BLOCK = 64
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

__all__ = ["ROWS", "FAMILIES", "check_model", "checked", "rope_tables", "by_tiles", "row_log_probs", "attend_by_length",
           "layer_forward", "prefill", "prefill_chunk", "decode", "install", "invariant_log_probs",
           "MismatchWarning", "step_metrics", "install_or_refuse"]


# --------------------------------------------------------------------------- scope


def check_model(spec: DecoderSpec) -> str | None:
    """Why the mode cannot hold for this architecture (one line), or None."""
    if spec.model_type not in FAMILIES:
        return f"model_type {spec.model_type!r} is not one of {', '.join(FAMILIES)}"
    a = spec.arch
    if any(la.window is not None or la.softcap is not None for la in a.layers) or a.final_softcap is not None:
        return f"{spec.model_type}: sliding windows and soft-caps are not in the batch-invariant attention"
    if a.moe is not None and (a.moe.scoring != "softmax" or a.moe.shared_intermediate_size):
        return f"{spec.model_type}: only softmax top-k routing without a shared expert is batch-invariant here"
    if spec.mla is not None or a.swiglu is not None or a.full_qk_norm or a.clip_qkv is not None:
        return f"{spec.model_type}: its attention / MLP variant is not in the batch-invariant forward"
    return None


def checked(spec: DecoderSpec, *, tp_size: int, cuda_graph: bool, speculative: bool, ep: Any, vlm: Any) -> Any:
    """This module (the sampler's forward under ``rollout.batch_invariant``) after the sampler-side checks;
    raises ValueError with the one-line reason where the mode cannot hold."""
    reason = check_model(spec)
    if reason is None and tp_size > 1:
        reason = f"a tensor-parallel rollout (tp={tp_size}) is not batch-invariant in this version"
    if reason is None and (cuda_graph or speculative or ep is not None or vlm is not None):
        reason = "CUDA graphs, speculative decoding, rollout.ep and vision inputs are outside the mode"
    if reason is not None:
        raise ValueError(f"rollout.batch_invariant: {reason}")
    import sys

    return sys.modules[__name__]


# --------------------------------------------------------------------------- row-wise pieces


def rope_tables(inv_freq: Tensor, scale: Tensor, max_seq_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """``decoder.rope_tables`` built ``ROPE_BLOCK`` positions at a time: ``[K, max_seq_len, R]`` cos and signed
    sin whose rows do not depend on ``max_seq_len`` (one shape per block, so one elementwise kernel path)."""
    blocks = -(-max_seq_len // ROPE_BLOCK)
    pos = torch.arange(blocks * ROPE_BLOCK, dtype=torch.int64).float().view(blocks, ROPE_BLOCK)
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1, 1)
    half = inv_freq.shape[-1]
    cos, sin = [], []
    for b in range(blocks):
        freqs = pos[b][None, :, None] * inv_freq[:, None, :]  # [K, BLOCK, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        c, s = emb.cos() * scale, emb.sin() * scale
        s[..., :half].neg_()
        cos.append(c)
        sin.append(s)
    cos_t, sin_t = torch.cat(cos, dim=1)[:, :max_seq_len], torch.cat(sin, dim=1)[:, :max_seq_len]
    return cos_t.to(device, dtype), sin_t.to(device, dtype)


def by_tiles(fn: Callable[..., Tensor], *rows: Tensor) -> Tensor:
    """``fn`` over tiles of exactly ``ROWS`` rows of ``rows`` (tensors with the same first dim M; the last tile
    padded with zeros), outputs concatenated back to M rows (differentiable)."""
    m = rows[0].shape[0]
    pad = (-m) % ROWS
    if pad:
        rows = tuple(torch.cat((r, r.new_zeros((pad, *r.shape[1:])))) for r in rows)
    # split, not slices: the backward of a split is one concatenation (of slices, a zero-filled copy each)
    outs = [fn(*parts) for parts in zip(*(r.split(ROWS) for r in rows))]
    out = torch.cat(outs) if len(outs) != 1 else outs[0]
    return out[:m] if pad else out


def row_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0,
                  compute_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """``log softmax(logits / T)[label]`` per row (``logits [M, V]``, ``labels [M]``) in row tiles: what both
    the sampler reports and the trainer computes. Returns ``[M]`` fp32 log-probs (and entropy ``[M]``)."""
    def tile(lg: Tensor, lab: Tensor) -> Tensor:
        lg = lg.float()
        if temperature != 1.0:
            lg = lg / temperature
        lp = lg.gather(-1, lab[:, None].long()).squeeze(-1) - torch.logsumexp(lg, dim=-1)
        return torch.stack((lp, entropy_from_logits(lg)), -1) if compute_entropy else lp[:, None]

    out = by_tiles(tile, logits, labels)
    return out[:, 0], (out[:, 1] if compute_entropy else None)


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``softmax(q k^T * scale) v`` for ``q [m, Hkv, G, D]``, contiguous ``k, v [m, Hkv, n, D]``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(v.dtype), v)


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``_attend`` of m query rows of one key length. On CPU one batched call (a batched matmul there computes
    each matrix alone: tests/unit/test_batch_invariant.py); elsewhere (untested: cuBLAS may pick its kernel
    by the batch count) in calls of exactly ``ROWS`` rows, the last padded with zeros."""
    if q.device.type == "cpu":
        return _attend(q, k, v, scale)
    outs = []
    for qc, kc, vc in zip(q.split(ROWS), k.split(ROWS), v.split(ROWS)):
        m, pad = qc.shape[0], ROWS - qc.shape[0]
        if pad:
            qc, kc, vc = (torch.cat((t, t.new_zeros((pad, *t.shape[1:])))) for t in (qc, kc, vc))
        outs.append(_attend(qc, kc, vc, scale)[:m])
    return torch.cat(outs)


def attend_by_length(q: Tensor, lengths: Tensor, kv: Callable[[Tensor, int], tuple[Tensor, Tensor]],
                     scale: float) -> Tensor:
    """Attention of query rows ``q [M, Hkv, G, D]`` over their ``lengths [M]`` visible keys, one batched call per
    distinct length: ``kv(rows, n)`` gives the contiguous keys / values ``[len(rows), Hkv, n, D]`` of ``rows``.
    Returns ``[M, Hkv, G, D]`` (differentiable through ``q`` and what ``kv`` returns)."""
    outs, order = [], []
    for n in sorted(set(lengths.tolist())):
        rows = (lengths == n).nonzero().squeeze(1)
        k, v = kv(rows, n)
        outs.append(_attend_rows(q.index_select(0, rows).contiguous(), k.contiguous(), v.contiguous(), scale))
        order.append(rows)
    if len(outs) == 1:
        return outs[0]
    perm = torch.cat(order)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    return torch.cat(outs).index_select(0, inverse)


def _experts(spec: DecoderSpec, lw: LayerWeights, g: Tensor, routes: list | None) -> Tensor:
    """Routed experts of one tile ``g [ROWS, hidden]``: each expert's rows padded to a tile, the top-k
    contributions summed in top-k order; the tile's expert ids ``[ROWS, k]`` go to ``routes``."""
    a = spec.arch
    top_w, top_i = moe.route(a.moe, g, lw.router_w)
    if routes is not None:
        routes.append(top_i)
    k = top_i.shape[1]
    ys = g.new_zeros((g.shape[0] * k, g.shape[1]))
    flat = top_i.reshape(-1)
    for e in sorted(set(flat.tolist())):
        at = (flat == e).nonzero().squeeze(1)  # assignments (row * k + j) to expert e: at most ROWS
        x = g.index_select(0, at // k)
        x = torch.cat((x, x.new_zeros((ROWS - x.shape[0], x.shape[1])))) if x.shape[0] < ROWS else x
        h = F.linear(x, lw.experts_gate_up[e])
        i = h.shape[1] // 2
        y = F.linear(arch.gated_act(a, h[:, :i], h[:, i:]), lw.experts_down[e])
        ys = ys.index_copy(0, at, y[:at.shape[0]])
    ys = ys.view(g.shape[0], k, -1) * top_w[:, :, None]
    out = ys[:, 0]
    for j in range(1, k):
        out = out + ys[:, j]
    return out


def _mlp(spec: DecoderSpec, lw: LayerWeights, x: Tensor, routes: list | None) -> Tensor:
    """``x + MLP(RMSNorm(x))`` of one tile (the activation never in place: one kernel path with or without grad)."""
    g = decoder.rms_norm(x, lw.post_norm, spec.rms_norm_eps)
    if lw.router_w is not None:
        return x + _experts(spec, lw, g, routes)
    gu = F.linear(g, lw.gate_up_w, lw.gate_up_b)
    i = gu.shape[1] // 2
    act = arch.gated_act(spec.arch, gu[:, :i], gu[:, i:])
    return decoder._residual_linear(x, act, lw.down_w, lw.down_b, None)


def layer_forward(spec: DecoderSpec, lw: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor,
                  attend: Callable[[Tensor], Tensor], routes: list | None = None) -> Tensor:
    """One decoder layer over rows ``x [M, hidden]`` (``cos, sin [M, 1, R]``: each row's rope rows).
    ``attend(qkv [M, H + 2Hkv, D]) -> [M, H * D]``: the side's attention (cache write and read, or the
    trainer's own sequences), itself batch-invariant. ``routes``: a sparse layer's expert ids ``[M, k]``."""
    qkv = by_tiles(lambda t, c, s: decoder._qkv(spec, lw, t, (t.shape[0],), c, s), x, cos, sin)
    a = attend(qkv)
    part: list | None = [] if routes is not None else None
    out = by_tiles(lambda t, at: _mlp(spec, lw, decoder._residual_linear(t, at, lw.o_w, lw.o_b, None), part), x, a)
    if part:
        routes.append(torch.cat(part)[:x.shape[0]])
    return out


def _logits(spec: DecoderSpec, w: DecoderWeights, x: Tensor) -> Tensor:
    return by_tiles(lambda t: decoder._logits(spec, w, t), x)


def _heads(spec: DecoderSpec, qkv: Tensor) -> Tensor:
    """The query heads of ``qkv [M, Hall, D]`` as ``[M, Hkv, G, D]`` (query head h reads kv head h // G)."""
    h, hkv = spec.num_heads, spec.num_kv_heads
    return qkv[:, :h].reshape(qkv.shape[0], hkv, h // hkv, spec.head_dim)


def _sequence_attend(spec: DecoderSpec, qkv: Tensor, positions: Tensor, scale: float) -> Tensor:
    """Causal attention within packed sequences: the token at flat index j and position p sees flat tokens
    ``[j - p, j]``. ``qkv [M, Hall, D]`` -> ``[M, H * D]``."""
    h, hkv = spec.num_heads, spec.num_kv_heads
    k_all, v_all = qkv[:, h:h + hkv], qkv[:, h + hkv:]  # [M, Hkv, D]
    idx = torch.arange(qkv.shape[0], device=qkv.device)

    def kv(rows: Tensor, n: int) -> tuple[Tensor, Tensor]:
        cols = (idx.index_select(0, rows) - (n - 1))[:, None] + torch.arange(n, device=qkv.device)  # [m, n]
        return k_all[cols].transpose(1, 2), v_all[cols].transpose(1, 2)  # [m, Hkv, n, D]

    return attend_by_length(_heads(spec, qkv), positions + 1, kv, scale).reshape(qkv.shape[0], -1)


# --------------------------------------------------------------------------- the sampler's entry points
# Same signatures as rlhf.models.decoder's prefill / prefill_chunk / decode (the sampler picks the module).


def prefill(spec: DecoderSpec, w: DecoderWeights, cache: Any, input_ids: Tensor, positions: Tensor,
            grid_index: Tensor | None, width: int, last_index: Tensor, slots: Tensor, rows: Tensor, cos: Tensor,
            sin: Tensor, tp_group: Any = None, embeds: Tensor | None = None, deepstack: Tensor | None = None,
            routes: list | None = None, runs: list | None = None) -> Tensor:
    """``decoder.prefill`` in the batch-invariant scheme (no VLM inputs, no route recording, one TP rank)."""
    assert tp_group is None and embeds is None and deepstack is None, "batch_invariant scope"
    p, total = last_index.shape[0], input_ids.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    index = None if runs is not None else cache.prefill_index(slots, 0, width)
    x = arch.embed(spec.arch, w.embed, input_ids)
    for layer, lw in enumerate(w.layers):
        la = spec.arch.layers[layer]

        def attend(qkv: Tensor) -> Tensor:
            grid = qkv if grid_index is None else qkv.new_zeros((p * width, h + 2 * hkv, d)).index_copy_(
                0, grid_index, qkv)
            grid = grid.view(p, width, -1, d).transpose(1, 2)  # [P, Hall, width, D]
            if runs is not None:
                cache.write_runs(layer, runs, grid[:, h:])
            else:
                cache.write(layer, index, grid[:, h:].index_select(0, rows))
            return _sequence_attend(spec, qkv, positions, la.scale)

        x = layer_forward(spec, lw, x, cos[la.rope, positions, None], sin[la.rope, positions, None], attend, routes)
    return _logits(spec, w, x.index_select(0, last_index))


def _cache_attend(spec: DecoderSpec, cache: Any, layer: int, q: Tensor, lengths: Tensor, slots: Tensor,
                  window: int, scale: float) -> Tensor:
    """Queries ``q [M, Hkv, G, D]`` over the cache of ``slots [M]`` (query i sees columns ``[0, lengths[i])``)."""
    k_all, v_all = cache.view(layer, slots, window)  # [M, Hkv, W, D]

    def kv(rows: Tensor, n: int) -> tuple[Tensor, Tensor]:
        return k_all.index_select(0, rows)[:, :, :n], v_all.index_select(0, rows)[:, :, :n]

    return attend_by_length(q, lengths, kv, scale).reshape(q.shape[0], -1)


def prefill_chunk(spec: DecoderSpec, w: DecoderWeights, cache: Any, input_ids: Tensor, start: int, slots: Tensor,
                  cos: Tensor, sin: Tensor, tp_group: Any = None, embeds: Tensor | None = None,
                  deepstack: Tensor | None = None, routes: list | None = None, rope_shift: int = 0) -> Tensor:
    """``decoder.prefill_chunk`` in the batch-invariant scheme (a long prompt's tokens [start, start + c))."""
    assert tp_group is None and embeds is None and deepstack is None, "batch_invariant scope"
    n = input_ids.shape[0]
    positions = torch.arange(start, start + n, device=input_ids.device)
    index = cache.prefill_index(slots, start, n)
    own = slots[:1].expand(n)
    x = arch.embed(spec.arch, w.embed, input_ids)
    for layer, lw in enumerate(w.layers):
        la = spec.arch.layers[layer]

        def attend(qkv: Tensor) -> Tensor:
            cache.write(layer, index, qkv[:, spec.num_heads:].transpose(0, 1).unsqueeze(0)
                        .expand(slots.shape[0], -1, -1, -1))
            return _cache_attend(spec, cache, layer, _heads(spec, qkv), positions + 1, own, start + n, la.scale)

        rp = positions + rope_shift
        x = layer_forward(spec, lw, x, cos[la.rope, rp, None], sin[la.rope, rp, None], attend, routes)
    return _logits(spec, w, x[-1:])


def decode(spec: DecoderSpec, w: DecoderWeights, cache: Any, tokens: Tensor, pos: Tensor, window: int, cos: Tensor,
           sin: Tensor, tp_group: Any = None, rope_pos: Tensor | None = None, routes: list | None = None) -> Tensor:
    """``decoder.decode`` in the batch-invariant scheme: slot b's token at ``pos[b]`` sees columns [0, pos[b]]."""
    assert tp_group is None, "batch_invariant scope"
    b = tokens.shape[0]
    rp = pos if rope_pos is None else rope_pos
    index = cache.decode_index(pos)
    slots = torch.arange(b, device=tokens.device)
    x = arch.embed(spec.arch, w.embed, tokens)
    for layer, lw in enumerate(w.layers):
        la = spec.arch.layers[layer]

        def attend(qkv: Tensor) -> Tensor:
            cache.write(layer, index, qkv[:, spec.num_heads:])
            return _cache_attend(spec, cache, layer, _heads(spec, qkv), pos + 1, slots, window, la.scale)

        x = layer_forward(spec, lw, x, cos[la.rope, rp, None], sin[la.rope, rp, None], attend, routes)
    return _logits(spec, w, x)


# --------------------------------------------------------------------------- the trainer's forward


class MismatchWarning(UserWarning):
    """A step of ``rollout.batch_invariant`` found a sampler log-prob that differs from the trainer's."""


def _decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """The HF causal LM's decoder stack (``model.model``: embed_tokens, layers, norm) and its LM head."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise ValueError(f"rollout.batch_invariant: {type(model).__name__} has no model.layers / lm_head")
    return inner, model.lm_head


def _unwrapped(layer: torch.nn.Module) -> torch.nn.Module:
    """The decoder layer inside an activation-checkpoint wrapper (its parameters are the same)."""
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def install(model: torch.nn.Module, hf_config: Any) -> DecoderSpec:
    """Replace the forwards of ``model`` (an HF causal LM, possibly FSDP2-wrapped) and of its decoder layers by
    the batch-invariant ones; returns the spec. The model is then called as
    ``model(input_ids, attention_mask, response_length=R, temperature=T, compute_entropy=...)`` and returns
    ``(log_probs [B, R], entropy [B, R] | None)`` (``invariant_log_probs``)."""
    spec = DecoderSpec.from_config(hf_config)
    reason = check_model(spec)
    if reason is not None:
        raise ValueError(f"rollout.batch_invariant: {reason}")
    inner, _ = _decoder_parts(model)
    inv_freq, rope_scale = decoder.rope_inv_freq(hf_config, spec.head_dim)
    for i, layer in enumerate(inner.layers):
        mod = _unwrapped(layer)
        mod.forward = types.MethodType(_layer_module_forward(spec, i), mod)
    model.forward = types.MethodType(_model_forward(spec, inv_freq, rope_scale), model)
    return spec


def install_or_refuse(model: torch.nn.Module, hf_config: Any) -> bool:
    """``install``, with the reason it cannot as a one-line ConfigError (the model family is known only here)."""
    from rlhf.schema.config import ConfigError

    try:
        install(model, hf_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return True


def _layer_module_forward(spec: DecoderSpec, i: int) -> Callable[..., Tensor]:
    def forward(self: torch.nn.Module, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        lw = layer_weights(spec, i, dict(self.named_parameters()))
        la = spec.arch.layers[i]
        return layer_forward(spec, lw, x, cos, sin, lambda qkv: _sequence_attend(spec, qkv, positions, la.scale))
    return forward


def _model_forward(spec: DecoderSpec, inv_freq: Tensor, rope_scale: Tensor) -> Callable[..., Any]:
    def forward(self: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, *, response_length: int,
                temperature: float = 1.0, compute_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        inner, head = _decoder_parts(self)
        mask = attention_mask.bool()
        b, length = input_ids.shape
        r = response_length
        flat_index = (mask.reshape(-1).long().cumsum(0) - 1).view(b, length)
        positions = (mask.long().cumsum(-1) - 1)[mask]  # [Ttot] each real token's position in its row
        x = arch.embed(spec.arch, inner.embed_tokens.weight, input_ids[mask])
        dtype = x.dtype
        cos, sin = rope_tables(inv_freq, rope_scale, int(positions.max()) + 1 if positions.numel() else 1, dtype,
                               x.device)
        for i, layer in enumerate(inner.layers):
            rope = spec.arch.layers[i].rope
            x = layer(x, positions, cos[rope, positions, None], sin[rope, positions, None])
        # the logits that score response token t (column L-R+t) come from column L-R+t-1
        pred = flat_index[:, length - r - 1:length - 1]
        valid = mask[:, length - r - 1:length - 1] & mask[:, length - r:]
        w = DecoderWeights(embed=inner.embed_tokens.weight, layers=[], norm=arch.norm_weight(spec.arch,
                           inner.norm.weight), lm_head=head.weight)
        logits = _logits(spec, w, x.index_select(0, pred[valid]))
        lp, ent = row_log_probs(logits, input_ids[:, length - r:][valid], temperature, compute_entropy)
        out = lp.new_zeros((b, r)).index_put((valid.nonzero(as_tuple=True)), lp)
        entropy = None if ent is None else ent.new_zeros((b, r)).index_put(valid.nonzero(as_tuple=True), ent)
        return out, entropy
    return forward


def invariant_log_probs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, *, response_length: int,
                        temperature: float, compute_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced log-probs ``[B, R]`` (and entropy) of the last R tokens through an ``install``-ed model:
    the same bits the sampler reported for those tokens (0 where a token is padding)."""
    return model(input_ids, attention_mask, response_length=response_length, temperature=temperature,
                 compute_entropy=compute_entropy)


_WARNED: dict[str, bool] = {}


def step_metrics(diff: float, model_type: str, device: str) -> dict[str, float]:
    """``mismatch/max_abs_logprob_diff`` of a step's old-log-prob pass (``diff``: the global max over response
    tokens of |trainer - sampler|), and the one-line warning, once per process, of the first nonzero one."""
    if diff != 0.0 and not _WARNED.get("diff"):
        _WARNED["diff"] = True
        warnings.warn(f"rollout.batch_invariant: max |trainer - sampler| log-prob = {diff:.3g} on {model_type} "
                      f"({device}): the row-tiled matmuls or the attention by key length were not batch-invariant "
                      "on this device and dtype (see docs/howto/batch-invariant.md)", MismatchWarning, stacklevel=2)
    return {"mismatch/max_abs_logprob_diff": diff}
