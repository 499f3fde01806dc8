"""Functional forward of HF decoder-only LMs over a weight dict (families: ``rlhf.models.arch``).

The rollout gathers the trainer's parameters into ``dict[str, Tensor]`` keyed by HF
state-dict names and runs this forward on them: no ``nn.Module``, no HF cache objects,
two entry points (``prefill`` over right-padded prompts, ``decode`` of one token per slot).

Per layer (pre-norm transformer, HF numerics):

    h = x + o_proj(Attn(rope(q), rope(k), v))      q, k, v = qkv_proj(RMSNorm(x))
    y = h + down_proj(silu(gate_proj(g)) * up_proj(g))   g = RMSNorm(h)

RMSNorm(x) = w * (x / sqrt(mean(x^2) + eps)) computed in fp32; rotary embedding
``x * cos + rotate_half(x) * sin`` with HF's inverse frequencies (any static rope type HF
knows, e.g. default / linear / llama3 / yarn). q/k/v and gate/up are fused into one matmul
each at load time. Family variants (Gemma's scaled embeddings, ``1 + w`` norms and sandwich
norms, GeGLU, soft-capping, sliding windows, per-layer rope tables, Phi-3's fused checkpoints
and partial rotary, Qwen3-MoE's routed experts) come from ``rlhf.models.arch`` /
``rlhf.models.moe`` at a few dispatch points; attention is ``arch.attend``.

Tensor parallel hook: every function takes ``tp_group``. A tensor-parallel rollout passes
column-sharded q/k/v and gate/up weights, row-sharded o_proj / down_proj weights, a spec
with the local head counts (``DecoderSpec.shard``) and the group; the partial outputs of
o_proj and down_proj are all-reduced over it. MoE layers split their experts over the group
instead (``rlhf.models.moe``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rlhf.models import arch, fp8, mla, moe, moe_archs
from rlhf.models.arch import SUPPORTED_MODEL_TYPES, ArchSpec
from rlhf.models.decoder_weights import DecoderWeights, LayerWeights, expert_weights, prepare_weights

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderSpec", "DecoderWeights", "LayerWeights", "prepare_weights", "expert_weights",
           "prefill", "prefill_chunk", "decode"]


@dataclass(frozen=True)
class DecoderSpec:
    """Architecture numbers the functional forward needs (read from an HF config)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    arch: ArchSpec  # family variants, per-layer attention settings
    # expert-parallel rollout (rollout.ep > 1): rlhf.rollout.expert_dispatch.RolloutEP, whose ``experts``
    # replaces rlhf.models.moe.experts in the sparse layers; None: this rank holds its replica's experts
    ep: Any = dataclasses.field(default=None, compare=False, repr=False)
    mla: mla.MLADims | None = None  # DeepSeek-V3's latent attention (rlhf.models.mla): head_dim is its cache width

    @classmethod
    def from_config(cls, config: Any) -> DecoderSpec:
        model_type = arch.check_model_type(config)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dims = mla.MLADims.from_config(config) if model_type == "deepseek_v3" else None
        if dims is not None:  # K and V are decompressed per query head
            kv_heads, head_dim = heads, dims.head_dim
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            arch=arch.from_config(config, head_dim),
            mla=dims,
        )

    def shard(self, tp_size: int) -> DecoderSpec:
        """Spec with the per-rank head / MLP sizes of a ``tp_size``-way tensor-parallel rollout."""
        sizes = {"num_heads": self.num_heads}
        kv = self.num_kv_heads  # a rollout wider than the KV heads replicates them (one per rank, as vLLM)
        if kv % tp_size and tp_size % kv:
            sizes["num_kv_heads"] = kv
        m = self.arch.moe
        if m is None or m.has_dense_layers:
            sizes["intermediate_size"] = self.intermediate_size
        if m is not None:  # experts are split over tp, each one whole
            sizes["num_experts"] = m.num_experts
            if m.shared_intermediate_size:
                sizes["shared_expert_intermediate_size"] = m.shared_intermediate_size
        if any(v % tp_size for v in sizes.values()):
            raise ValueError(f"tp_size={tp_size} must divide " + ", ".join(f"{k}={v}" for k, v in sizes.items()))
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // tp_size,
            num_kv_heads=max(1, self.num_kv_heads // tp_size),
            intermediate_size=self.intermediate_size // tp_size,
        )

    def check_seq_len(self, max_seq_len: int) -> None:
        arch.check_seq_len(self.arch, self.model_type, max_seq_len)


def check_supported(config: Any, max_seq_len: int | None = None) -> DecoderSpec:
    """Everything about an HF config the sampler refuses, found before any weight is loaded (model type,
    activation, rope type, a sliding window shorter than ``max_seq_len``); raises NotImplementedError.
    The checks are the sampler's own, so an architecture added to it is accepted here too. A supported
    Qwen-VL is checked on its language model (``arch.VL_TEXT_FAMILY``)."""
    if getattr(config, "model_type", None) in arch.VL_TEXT_FAMILY:
        config = arch.vl_text_config(config)
    spec = DecoderSpec.from_config(config)
    rope_inv_freq(config, spec.head_dim)
    if max_seq_len is not None:
        spec.check_seq_len(max_seq_len)
    return spec


def rope_inv_freq(config: Any, head_dim: int) -> tuple[Tensor, Tensor]:
    """HF's inverse frequencies ``[K, rotary_dim // 2]`` float32 and cos/sin scales ``[K]``, one row
    per rope table (``arch.rope_inv_freq``; K = 1 except Gemma 3)."""
    return arch.rope_inv_freq(config, arch.rotary_dim(config, head_dim))


def rope_tables(inv_freq: Tensor, scale: Tensor, max_seq_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables ``[K, max_seq_len, R]`` (fp32 like HF, then cast; R = rotary dim).

    HF's ``rotate_half(x) * sin`` equals ``roll(x, R/2) * sin_signed`` with
    ``sin_signed = [-sin[:R/2], sin[R/2:]]`` (both halves of ``sin`` are equal), which
    saves the negation of half of x at every layer.
    """
    pos = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = pos[None, :, None] * inv_freq[:, None, :]  # [K, S, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1, 1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = inv_freq.shape[-1]
    sin[..., :half].neg_()
    return cos.to(device, dtype), sin.to(device, dtype)


# --------------------------------------------------------------------------- math


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """HF RMSNorm over the last dim: normalise in fp32, cast back, then scale by ``weight``.

    A float32 ``weight`` on a lower-precision ``x`` is Gemma's ``1 + w``: applied before the
    cast back, as HF's Gemma norms do. ``weight`` may also be a per-head table ``[Hq + Hk, D]``.
    """
    if x.dtype == torch.float32 and (weight is None or weight.dim() == 1):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op, same fp32 math
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xf.to(x.dtype)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def apply_rope_(qk: Tensor, cos: Tensor, sin_signed: Tensor) -> None:
    """In place on the q and k heads ``qk`` ``[..., Hq + Hkv, D]`` (a view of the fused projection):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin = roll(x, R/2) * sin_signed``, on
    the leading ``R = cos.shape[-1]`` dims of each head (partial rotary: the rest pass through).
    ``cos, sin_signed`` ``[..., 1, R]`` (rows of the tables) broadcast over the heads; v is never
    touched, so no per-head factor tensors and no copy of the fused tensor are needed."""
    r = cos.shape[-1]
    x = qk[..., :r] if r < qk.shape[-1] else qk
    rot = x.roll(r // 2, dims=-1)
    x.mul_(cos).addcmul_(rot, sin_signed)


def _residual_linear(x: Tensor, a: Tensor, w: Tensor, b: Tensor | None, tp_group: Any,
                     out_norm: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """``x + a @ w.T (+ b)`` for 2-D ``x`` ``[M, C]``; the partial product is all-reduced under TP.
    With ``out_norm`` (Gemma's sandwich norms): ``x + RMSNorm(a @ w.T (+ b))``."""
    if tp_group is None and b is None and out_norm is None and not isinstance(w, fp8.Fp8Weight):
        return torch.addmm(x, a, w.t())  # residual fused into the matmul
    return _residual_add(x, fp8.linear(a, w), b, tp_group, out_norm, eps)


def _residual_add(x: Tensor, out: Tensor, b: Tensor | None, tp_group: Any, out_norm: Tensor | None,
                  eps: float) -> Tensor:
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)
    if b is not None:
        out = out + b
    return x + (out if out_norm is None else rms_norm(out, out_norm, eps))


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else 0


def _qkv(spec: DecoderSpec, lw: LayerWeights, x: Tensor, lead: tuple[int, ...], cos: Tensor, sin: Tensor,
         tp_group: Any = None) -> Tensor:
    """Fused, normed (qwen3) and rotated q|k|v: ``x`` ``[M, hidden]`` -> ``[*lead, H + 2Hkv, D]``.

    ``lead`` splits the M rows (``(B,)`` or ``(P, Tp)``); ``cos, sin`` ``[*lead, 1, R]``: the rope
    table rows of each token's position.
    """
    if spec.mla is not None:
        qkv = mla.qkv(rms_norm(x, lw.input_norm, spec.rms_norm_eps), lw, spec.mla, spec.num_heads, spec.rms_norm_eps,
                      rms_norm).view(*lead, -1, spec.head_dim)
        apply_rope_(qkv[..., :2 * spec.num_heads, :], cos, sin)
        return qkv
    qkv = fp8.linear(rms_norm(x, lw.input_norm, spec.rms_norm_eps), lw.qkv_w, lw.qkv_b)
    if lw.q_norm_full is not None:  # OLMoE: before the heads are split (rlhf.models.moe_archs)
        d = spec.head_dim
        qkv = moe_archs.full_qk_norm(qkv, lw.q_norm_full, lw.k_norm_full, spec.num_heads * d, spec.num_kv_heads * d,
                                     spec.rms_norm_eps, tp_group)
    if spec.arch.clip_qkv is not None:
        qkv = qkv.clamp(-spec.arch.clip_qkv, spec.arch.clip_qkv)
    qkv = qkv.view(*lead, -1, spec.head_dim)
    n_qk = spec.num_heads + spec.num_kv_heads
    if lw.qk_norm is not None:  # per-head RMSNorm of q and k (not v) before rope
        normed = rms_norm(qkv[..., :n_qk, :], lw.qk_norm, spec.rms_norm_eps)
        qkv = torch.cat((normed, qkv[..., n_qk:, :]), dim=-2)
    apply_rope_(qkv[..., :n_qk, :], cos, sin)
    return qkv


# A prefill's MLP runs over row chunks of this many tokens (without TP: each chunk is complete, so
# no extra all-reduce). The [M, 2I] intermediates of a long prefill otherwise take fresh pages from
# the OS in every layer (glibc hands freed multi-MB blocks back): on CPU the page faults were 29%
# of a 1075-token prefill (docs/benchmarks.md).
_MLP_ROWS = 256


def _mlp(spec: DecoderSpec, lw: LayerWeights, x: Tensor, tp_group: Any, routes: list | None = None) -> Tensor:
    """``x + down(act(gate(g)) * up(g))``, ``g = RMSNorm(x)``; ``x`` ``[M, hidden]``; routed
    experts in a MoE layer (``rlhf.models.moe``), whose top-k ids ``[M, k]`` go to ``routes``."""
    if tp_group is None and x.shape[0] > _MLP_ROWS and (spec.ep is None or lw.router_w is None):
        part: list | None = [] if routes is not None else None
        out = torch.cat([_mlp(spec, lw, rows, None, part) for rows in x.split(_MLP_ROWS)])
        if part:
            routes.append(torch.cat(part))
        return out
    g = rms_norm(x, lw.post_norm, spec.rms_norm_eps)
    eps, a = spec.rms_norm_eps, spec.arch
    if lw.router_w is not None:
        top_w, top_i = moe.route(a.moe, g, lw.router_w, lw.router_b, lw.select_bias)
        if routes is not None:
            routes.append(top_i)
        gu, dn, kw = expert_weights(lw)
        # under rollout.ep the rows of a layer go to the ep peers in ONE all-to-all (never split: each
        # peer must join exactly once per layer and pass)
        run = moe.experts if spec.ep is None else spec.ep.experts
        out = run(g, top_i, top_w, gu, dn, lambda u, v: arch.gated_act(a, u, v),
                  expert_offset=_rank(tp_group) * gu.shape[0], **kw)
        if lw.shared_gate_up is not None:  # Qwen2-MoE (a partial sum under tp, like the experts')
            out = out + moe_archs.shared_expert(g, lw.shared_gate_up, lw.shared_down, lw.shared_gate,
                                                lambda u, v: arch.gated_act(a, u, v))
        return _residual_add(x, out, None, tp_group, lw.mlp_out_norm, eps)
    gu = fp8.linear(g, lw.gate_up_w, lw.gate_up_b)
    i = spec.intermediate_size
    # gu is this call's own tensor: outside autograd the activation overwrites its gate half in place
    act = arch.gated_act(a, gu[:, :i], gu[:, i:], inplace=not torch.is_grad_enabled())
    return _residual_linear(x, act, lw.down_w, lw.down_b, tp_group, lw.mlp_out_norm, eps)


def _heads_out(spec: DecoderSpec, a: Tensor) -> Tensor:
    """Attention output ``[..., D]`` per head -> the ``o_proj`` input dims (MLA: the value's ``Dv`` of the padded D)."""
    return a if spec.mla is None or spec.mla.v == spec.head_dim else a[..., :spec.mla.v]


def _logits(spec: DecoderSpec, w: DecoderWeights, x: Tensor) -> Tensor:
    logits = F.linear(rms_norm(x, w.norm, spec.rms_norm_eps), w.lm_head)
    return arch.softcap_logits(spec.arch, logits).float()


def prefill(
    spec: DecoderSpec,
    w: DecoderWeights,
    cache: Any,
    input_ids: Tensor,
    positions: Tensor,
    grid_index: Tensor | None,
    width: int,
    last_index: Tensor,
    slots: Tensor,
    rows: Tensor,
    cos: Tensor,
    sin: Tensor,
    tp_group: Any = None,
    embeds: Tensor | None = None,
    deepstack: Tensor | None = None,
    routes: list | None = None,
    runs: list[tuple[int, int, int, int]] | None = None,
) -> Tensor:
    """Forward of P packed prompts; stores their K/V in the cache; returns last-token logits.

    Padding-free: projections and MLP run on the ``Ttot`` real tokens only. Attention
    scatters q/k/v into a right-padded ``[P, Hall, width, D]`` grid (pads are zeros that
    causal masking keeps real tokens from reading) and gathers its output back.

    Args:
        input_ids, positions: ``[Ttot]`` the prompts concatenated, and each token's position.
        grid_index: ``[Ttot]`` row of each token in the ``[P * width]`` grid
            (``prompt * width + position``); None when all prompts have length ``width``.
        last_index: ``[P]`` index of each prompt's last token in the packed sequence.
        slots: ``[M]`` cache slots to fill; ``rows`` ``[M]`` the prompt each slot receives,
            so one prefill serves the ``n`` samples of a prompt.
        cos, sin: rope tables from ``rope_tables`` (rows indexed by ``positions``).
        embeds: ``[Ttot, hidden]`` input embeddings instead of the token ids' (a VLM prompt's, image
            features placed: ``rlhf.rollout.vision``).
        deepstack: ``[L, Ttot, hidden]`` Qwen3-VL's deepstack features, added to the output of layer
            ``l < L`` (zeros off the image tokens).
        routes: a MoE's list to receive each sparse layer's top-k expert ids ``[Ttot, k]`` (routing replay).
        runs: the slot regions' runs of ``slots`` (``PagedKVCache.prefill_runs``): K/V written per run.
    Returns:
        ``[P, V]`` float32 logits of the token after each prompt.
    """
    p, total = last_index.shape[0], input_ids.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    c, s = cos[:, positions, None], sin[:, positions, None]  # [K, Ttot, 1, R] per rope table
    index = None if runs is not None else cache.prefill_index(slots, 0, width)  # [M * 2Hkv * width], all layers
    masks = arch.Masks(None, width, input_ids.device)
    x = arch.embed(spec.arch, w.embed, input_ids) if embeds is None else embeds  # [Ttot, hidden]
    for layer, lw in enumerate(w.layers):
        la = arch.with_sinks(spec.arch.layers[layer], lw.sinks)
        qkv = _qkv(spec, lw, x, (total,), c[la.rope], s[la.rope], tp_group)  # [Ttot, Hall, D]
        if grid_index is not None:
            qkv = qkv.new_zeros((p * width, h + 2 * hkv, d)).index_copy_(0, grid_index, qkv)
        grid = qkv.view(p, width, -1, d).transpose(1, 2)  # [P, Hall, width, D]
        if runs is not None:
            cache.write_runs(layer, runs, grid[:, h:])
        else:
            cache.write(layer, index, grid[:, h:].index_select(0, rows))
        a = arch.attend(grid[:, :h], grid[:, h : h + hkv], grid[:, h + hkv :], masks, la)  # [P, H, width, D]
        a = _heads_out(spec, a.transpose(1, 2)).reshape(p * width, -1)
        if grid_index is not None:
            a = a.index_select(0, grid_index)  # [Ttot, H*D]
        x = _residual_linear(x, a, lw.o_w, lw.o_b, tp_group, lw.attn_out_norm, spec.rms_norm_eps)
        x = _mlp(spec, lw, x, tp_group, routes)
        if deepstack is not None and layer < deepstack.shape[0]:
            x = x + deepstack[layer]
    return _logits(spec, w, x.index_select(0, last_index))


def prefill_chunk(
    spec: DecoderSpec,
    w: DecoderWeights,
    cache: Any,
    input_ids: Tensor,
    start: int,
    slots: Tensor,
    cos: Tensor,
    sin: Tensor,
    tp_group: Any = None,
    embeds: Tensor | None = None,
    deepstack: Tensor | None = None,
    routes: list | None = None,
    rope_shift: int = 0,
) -> Tensor:
    """Chunked prefill: forward of tokens ``[start, start + c)`` of ONE prompt whose earlier
    positions are already in the cache of ``slots[0]``.

    The chunk's K/V go to every slot in ``slots`` ``[M]`` (the prompt's samples); its queries
    attend to cache positions ``[0, start + c)`` with the causal offset, so the attention
    matrix is ``c x (start + c)`` instead of ``T x T`` for a long prompt. Grouped-query
    attention folds the ``G = H / Hkv`` query heads of a kv head into its query rows
    (``[Hkv, G * c, D]``, the mask repeated per group), as decode does: SDPA with a mask and
    ``enable_gqa`` falls back to the math kernel (fp32 ``[H, c, W]`` scores).

    Args:
        input_ids: ``[c]`` the chunk's tokens; ``embeds`` ``[c, hidden]`` their embeddings when given,
            ``deepstack`` ``[L, c, hidden]`` their deepstack features (as ``prefill``).
        cos, sin: rope tables, rows indexed by cache position (a VLM prompt's own rows).
        rope_shift: added to the cache positions to pick the rope rows: a VLM's text after its
            prompt rotates by cache position + the prompt's M-RoPE delta (a resumed multi-turn sequence).
    Returns:
        ``[1, V]`` float32 logits of the token after the chunk.
    """
    n = input_ids.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    positions = torch.arange(start, start + n, device=input_ids.device)
    c, s = cos[:, positions + rope_shift, None], sin[:, positions + rope_shift, None]  # [K, c, 1, R]
    index = cache.prefill_index(slots, start, n)
    window = start + n
    g = h // hkv
    masks = arch.Masks(positions.repeat(g), window, input_ids.device)  # [G * c, W]: row (j, i) = query i of member j
    x = arch.embed(spec.arch, w.embed, input_ids) if embeds is None else embeds  # [c, hidden]
    for layer, lw in enumerate(w.layers):
        la = arch.with_sinks(spec.arch.layers[layer], lw.sinks)
        qkv = _qkv(spec, lw, x, (n,), c[la.rope], s[la.rope], tp_group).transpose(0, 1)  # [Hall, c, D]
        cache.write(layer, index, qkv[h:].unsqueeze(0).expand(slots.shape[0], -1, -1, -1))
        k, v = cache.view(layer, slots[:1], window)  # [1, Hkv, W, D]
        q = qkv[:h].reshape(1, hkv, g * n, d)  # head kv * G + j -> kv head kv, rows j * c + i
        a = arch.attend(q, k, v, masks, la)  # [1, Hkv, G * c, D]
        a = _heads_out(spec, a.reshape(h, n, d).transpose(0, 1)).reshape(n, -1)
        x = _residual_linear(x, a, lw.o_w, lw.o_b, tp_group, lw.attn_out_norm, spec.rms_norm_eps)
        x = _mlp(spec, lw, x, tp_group, routes)
        if deepstack is not None and layer < deepstack.shape[0]:
            x = x + deepstack[layer]
    return _logits(spec, w, x[-1:])


def decode(
    spec: DecoderSpec,
    w: DecoderWeights,
    cache: Any,
    tokens: Tensor,
    pos: Tensor,
    window: int,
    cos: Tensor,
    sin: Tensor,
    tp_group: Any = None,
    rope_pos: Tensor | None = None,
    routes: list | None = None,
) -> Tensor:
    """One decode step for slots ``[0, B)``: token ``tokens[b]`` at position ``pos[b]``.

    Writes the new K/V into the cache and attends over cache positions ``[0, window)``
    masked to ``<= pos[b]``. Grouped-query attention without repeating K/V: the ``G = H /
    Hkv`` query heads that share a kv head are laid out as G query rows of that head
    (``[B, Hkv, G, D]``), which is exact for a single-token step.

    Args:
        tokens, pos: ``[B]`` int64; ``window`` > max(pos).
        rope_pos: ``[B]`` the rotary positions when they differ from the cache positions ``pos``
            (a VLM's text positions after its images: ``pos + rope delta``).
    Returns:
        ``[B, V]`` float32 logits.
    """
    b = tokens.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rp = pos if rope_pos is None else rope_pos
    c, s = cos[:, rp, None], sin[:, rp, None]  # [K, B, 1, R]
    index = cache.decode_index(pos)  # [B * 2Hkv]
    x = arch.embed(spec.arch, w.embed, tokens)  # [B, hidden]
    plan = cache.decode_plan(b, pos, window, x.dtype)  # the attention kernel's per-step data
    for layer, lw in enumerate(w.layers):
        la = arch.with_sinks(spec.arch.layers[layer], lw.sinks)
        qkv = _qkv(spec, lw, x, (b,), c[la.rope], s[la.rope], tp_group)  # [B, Hall, D]
        cache.write(layer, index, qkv[:, h:])
        a = cache.attend(layer, qkv[:, :h].view(b, hkv, h // hkv, d), plan, la)  # [B, Hkv, G, D]
        a = _heads_out(spec, a).reshape(b, -1)
        x = _residual_linear(x, a, lw.o_w, lw.o_b, tp_group, lw.attn_out_norm, spec.rms_norm_eps)
        x = _mlp(spec, lw, x, tp_group, routes)
    return _logits(spec, w, x)
