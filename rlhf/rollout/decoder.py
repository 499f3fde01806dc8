"""Functional forward of HF decoder-only LMs (Llama / Mistral / Qwen2 / Qwen3) over a weight dict.

The rollout gathers the trainer's parameters into ``dict[str, Tensor]`` keyed by HF
state-dict names and runs this forward on them: no ``nn.Module``, no HF cache objects,
two entry points (``prefill`` over right-padded prompts, ``decode`` of one token per slot).

Per layer (pre-norm transformer, HF numerics):

    h = x + o_proj(Attn(rope(q), rope(k), v))      q, k, v = qkv_proj(RMSNorm(x))
    y = h + down_proj(silu(gate_proj(g)) * up_proj(g))   g = RMSNorm(h)

RMSNorm(x) = w * (x / sqrt(mean(x^2) + eps)) computed in fp32; rotary embedding
``x * cos + rotate_half(x) * sin`` with HF's inverse frequencies (any static rope type HF
knows, e.g. default / linear / llama3 / yarn). q/k/v and gate/up are fused into one matmul
each at load time.

Tensor parallel hook: every function takes ``tp_group``. A tensor-parallel rollout passes
column-sharded q/k/v and gate/up weights, row-sharded o_proj / down_proj weights, a spec
with the local head counts (``DecoderSpec.shard``) and the group; the partial outputs of
o_proj and down_proj are all-reduced over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: Any) -> DecoderSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"rollout sampler: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(f"rollout sampler: hidden_act {act!r} of {model_type} is not supported (only silu)")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        window = None
        layer_types = getattr(config, "layer_types", None) or []
        if model_type == "mistral" or "sliding_attention" in layer_types:
            window = getattr(config, "sliding_window", None)
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
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=window,
        )

    def shard(self, tp_size: int) -> DecoderSpec:
        """Spec with the per-rank head / MLP sizes of a ``tp_size``-way tensor-parallel rollout."""
        if self.num_heads % tp_size or self.num_kv_heads % tp_size or self.intermediate_size % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads} and intermediate_size={self.intermediate_size}"
            )
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // tp_size,
            num_kv_heads=self.num_kv_heads // tp_size,
            intermediate_size=self.intermediate_size // tp_size,
        )

    def check_seq_len(self, max_seq_len: int) -> None:
        """Sliding-window attention is not implemented: refuse lengths where it would matter."""
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise NotImplementedError(
                f"rollout sampler: {self.model_type} uses sliding-window attention "
                f"(sliding_window={self.sliding_window}) and max_seq_len={max_seq_len} exceeds it; "
                "sliding windows are not implemented"
            )


def rope_inv_freq(config: Any, head_dim: int) -> tuple[Tensor, float]:
    """HF's inverse frequencies ``[head_dim // 2]`` float32 and cos/sin scaling factor."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers < 5
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type not in _STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"rollout sampler: rope_type {rope_type!r} of {config.model_type} is not supported; "
            f"supported: {', '.join(_STATIC_ROPE_TYPES)}"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scale)


def rope_tables(inv_freq: Tensor, scale: float, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables ``[max_seq_len, D]`` (fp32 like HF, then cast).

    HF's ``rotate_half(x) * sin`` equals ``roll(x, D/2) * sin_signed`` with
    ``sin_signed = [-sin[:D/2], sin[D/2:]]`` (both halves of ``sin`` are equal), which
    saves the negation of half of x at every layer.
    """
    pos = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = inv_freq.shape[0]
    sin[:, :half].neg_()
    return cos.to(device, dtype), sin.to(device, dtype)


@dataclass
class LayerWeights:
    """One decoder layer, with fused projections (``[out, in]`` like ``nn.Linear``)."""

    input_norm: Tensor  # [hidden]
    qkv_w: Tensor  # [(H + 2 Hkv) * D, hidden]
    qkv_b: Tensor | None
    qk_norm: Tensor | None  # [H + Hkv, D] (qwen3): q_norm weight on q heads, k_norm on k heads
    o_w: Tensor  # [hidden, H * D]
    o_b: Tensor | None
    post_norm: Tensor  # [hidden]
    gate_up_w: Tensor  # [2 * I, hidden]
    gate_up_b: Tensor | None
    down_w: Tensor  # [hidden, I]
    down_b: Tensor | None


@dataclass
class DecoderWeights:
    embed: Tensor  # [V, hidden]
    layers: list[LayerWeights]
    norm: Tensor  # [hidden]
    lm_head: Tensor  # [V, hidden]


def _copy_into(dst: Any, src: Any) -> Any:
    """Copy the tensor fields of ``src`` into ``dst``'s (same dataclass), keeping ``dst``'s storage;
    returns ``dst``."""
    for f in fields(dst):
        d, t = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(d, list):
            continue
        if (d is None) != (t is None):
            raise ValueError(f"load_weights: the new weights have a different structure ({f.name})")
        if d is not None and d is not t:
            d.copy_(t)
    return dst


def _qk_norm_table(spec: DecoderSpec, q: Tensor | None, k: Tensor | None) -> Tensor | None:
    if q is None or k is None:
        return None
    return torch.cat((q.expand(spec.num_heads, -1), k.expand(spec.num_kv_heads, -1))).contiguous()


def prepare_weights(
    spec: DecoderSpec, weights: Mapping[str, Tensor], *, device: torch.device, dtype: torch.dtype,
    consume: bool = False, copy: bool = False, into: DecoderWeights | None = None,
) -> DecoderWeights:
    """Move / cast the HF-named weights and fuse q|k|v and gate|up; raise listing missing names.

    Memory: tensors already on ``device`` in ``dtype`` are used as they are (no copy) unless
    ``copy``; the fused ones are new. ``consume``: ``weights`` is a dict the caller hands over;
    each tensor is popped from it as it is used, so the unfused tensors die while the fused
    ones are built (peak ~1x + one layer instead of 1x + every fused copy). ``into``: copy the
    result into these weights' tensors layer by layer (their storage kept: captured CUDA graphs
    read it) instead of returning new ones; peak + one layer.
    """
    missing: list[str] = []
    take = weights.pop if consume else weights.get  # type: ignore[attr-defined]

    def get(name: str, required: bool = True) -> Tensor | None:
        t = take(name, None)
        if t is None:
            if required:
                missing.append(name)
            return None
        return t.detach().to(device=device, dtype=dtype, copy=copy)

    def cat(*ts: Tensor | None) -> Tensor | None:
        if any(t is None for t in ts):
            return None
        return torch.cat(ts, dim=0).contiguous()  # type: ignore[arg-type]

    layers: list[LayerWeights] = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        q_b = get(a + "q_proj.bias", required=False)
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv_w=cat(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
                qkv_b=None if q_b is None else cat(q_b, get(a + "k_proj.bias"), get(a + "v_proj.bias")),
                qk_norm=_qk_norm_table(spec, get(a + "q_norm.weight"), get(a + "k_norm.weight"))
                if spec.qk_norm
                else None,
                o_w=get(a + "o_proj.weight"),
                o_b=get(a + "o_proj.bias", required=False),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up_w=cat(get(m + "gate_proj.weight"), get(m + "up_proj.weight")),
                gate_up_b=cat(get(m + "gate_proj.bias", False), get(m + "up_proj.bias", False)),
                down_w=get(m + "down_proj.weight"),
                down_b=get(m + "down_proj.bias", required=False),
            )
        )
        if into is not None and not missing:  # this layer goes into the old buffers; the new copy dies
            layers[-1] = _copy_into(into.layers[i], layers[-1])
    embed = get("model.embed_tokens.weight")
    norm = get("model.norm.weight")
    lm_head = get("lm_head.weight", required=not spec.tie_word_embeddings)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        given = ", ".join(list(weights)[:4])
        raise KeyError(f"rollout sampler: weights for {spec.model_type} are missing {shown}; got keys like {given}")
    out = DecoderWeights(embed=embed, layers=layers, norm=norm, lm_head=embed if lm_head is None else lm_head)
    return out if into is None else _copy_into(into, out)


# --------------------------------------------------------------------------- math


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """HF RMSNorm over the last dim: normalise in fp32, cast back, then scale by ``weight``."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op, same fp32 math
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if weight is None else weight * xf.to(x.dtype)


def head_rope(cos: Tensor, sin: Tensor, spec: DecoderSpec) -> tuple[Tensor, Tensor]:
    """Per-head rope factors ``[..., H + 2Hkv, D]`` for a fused q|k|v tensor.

    q and k heads get ``cos`` / signed ``sin`` (``[..., D]`` rows of the tables), v heads get
    cos = 1, sin = 0 so that rotating the whole fused tensor leaves v unchanged (exactly).
    """
    n_rot = spec.num_heads + spec.num_kv_heads
    is_rot = (torch.arange(n_rot + spec.num_kv_heads, device=cos.device) < n_rot)[:, None]  # [Hall, 1]
    c = torch.where(is_rot, cos.unsqueeze(-2), torch.ones((), dtype=cos.dtype, device=cos.device))
    s = torch.where(is_rot, sin.unsqueeze(-2), torch.zeros((), dtype=sin.dtype, device=sin.device))
    return c, s


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin = roll(x, D/2) * sin_signed``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _residual_linear(x: Tensor, a: Tensor, w: Tensor, b: Tensor | None, tp_group: Any) -> Tensor:
    """``x + a @ w.T (+ b)`` for 2-D ``x`` ``[M, C]``; the partial product is all-reduced under TP."""
    if tp_group is None and b is None:
        return torch.addmm(x, a, w.t())  # residual fused into the matmul
    out = F.linear(a, w)
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)
    return x + (out if b is None else out + b)


def _qkv(spec: DecoderSpec, lw: LayerWeights, x: Tensor, lead: tuple[int, ...], cos: Tensor, sin: Tensor) -> Tensor:
    """Fused, normed (qwen3) and rotated q|k|v: ``x`` ``[M, hidden]`` -> ``[*lead, H + 2Hkv, D]``.

    ``lead`` splits the M rows (``(B,)`` or ``(P, Tp)``); ``cos, sin`` are the per-head
    factors of ``head_rope``, broadcastable to the result.
    """
    qkv = F.linear(rms_norm(x, lw.input_norm, spec.rms_norm_eps), lw.qkv_w, lw.qkv_b)
    qkv = qkv.view(*lead, -1, spec.head_dim)
    if lw.qk_norm is not None:  # per-head RMSNorm of q and k (not v) before rope
        n_qk = spec.num_heads + spec.num_kv_heads
        normed = rms_norm(qkv[..., :n_qk, :], None, spec.rms_norm_eps) * lw.qk_norm
        qkv = torch.cat((normed, qkv[..., n_qk:, :]), dim=-2)
    return apply_rope(qkv, cos, sin)


def _mlp(spec: DecoderSpec, lw: LayerWeights, x: Tensor, tp_group: Any) -> Tensor:
    """``x + down(silu(gate(g)) * up(g))``, ``g = RMSNorm(x)``; ``x`` ``[M, hidden]``."""
    gu = F.linear(rms_norm(x, lw.post_norm, spec.rms_norm_eps), lw.gate_up_w, lw.gate_up_b)
    i = spec.intermediate_size
    return _residual_linear(x, F.silu(gu[:, :i]) * gu[:, i:], lw.down_w, lw.down_b, tp_group)


def _logits(spec: DecoderSpec, w: DecoderWeights, x: Tensor) -> Tensor:
    return F.linear(rms_norm(x, w.norm, spec.rms_norm_eps), w.lm_head).float()


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
        cos, sin: rope tables from ``rope_tables``.
    Returns:
        ``[P, V]`` float32 logits of the token after each prompt.
    """
    p, total = last_index.shape[0], input_ids.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    c, s = head_rope(cos[positions], sin[positions], spec)  # [Ttot, Hall, D]
    index = cache.prefill_index(slots, 0, width)  # [M * 2Hkv * width] cache rows, shared by the layers
    x = F.embedding(input_ids, w.embed)  # [Ttot, hidden]
    for layer, lw in enumerate(w.layers):
        qkv = _qkv(spec, lw, x, (total,), c, s)  # [Ttot, Hall, D]
        if grid_index is not None:
            qkv = qkv.new_zeros((p * width, h + 2 * hkv, d)).index_copy_(0, grid_index, qkv)
        grid = qkv.view(p, width, -1, d).transpose(1, 2)  # [P, Hall, width, D]
        cache.write(layer, index, grid[:, h:].index_select(0, rows))
        a = F.scaled_dot_product_attention(
            grid[:, :h], grid[:, h : h + hkv], grid[:, h + hkv :],
            is_causal=True, scale=d**-0.5, enable_gqa=h != hkv,
        )  # [P, H, width, D]
        a = a.transpose(1, 2).reshape(p * width, h * d)
        if grid_index is not None:
            a = a.index_select(0, grid_index)  # [Ttot, H*D]
        x = _residual_linear(x, a, lw.o_w, lw.o_b, tp_group)
        x = _mlp(spec, lw, x, tp_group)
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
        input_ids: ``[c]`` the chunk's tokens.
    Returns:
        ``[1, V]`` float32 logits of the token after the chunk.
    """
    n = input_ids.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    positions = torch.arange(start, start + n, device=input_ids.device)
    c, s = head_rope(cos[positions], sin[positions], spec)  # [c, Hall, D]
    index = cache.prefill_index(slots, start, n)
    window = start + n
    g = h // hkv
    mask = torch.arange(window, device=input_ids.device)[None, :] <= positions[:, None]  # [c, W]
    mask = mask.repeat(g, 1)  # [G * c, W]: row (j, i) = query i of group member j
    x = F.embedding(input_ids, w.embed)  # [c, hidden]
    for layer, lw in enumerate(w.layers):
        qkv = _qkv(spec, lw, x, (n,), c, s).transpose(0, 1)  # [Hall, c, D]
        cache.write(layer, index, qkv[h:].unsqueeze(0).expand(slots.shape[0], -1, -1, -1))
        k, v = cache.view(layer, slots[:1], window)  # [1, Hkv, W, D]
        q = qkv[:h].reshape(1, hkv, g * n, d)  # head kv * G + j -> kv head kv, rows j * c + i
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)  # [1, Hkv, G * c, D]
        x = _residual_linear(x, a.reshape(h, n, d).transpose(0, 1).reshape(n, h * d), lw.o_w, lw.o_b, tp_group)
        x = _mlp(spec, lw, x, tp_group)
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
) -> Tensor:
    """One decode step for slots ``[0, B)``: token ``tokens[b]`` at position ``pos[b]``.

    Writes the new K/V into the cache and attends over cache positions ``[0, window)``
    masked to ``<= pos[b]``. Grouped-query attention without repeating K/V: the ``G = H /
    Hkv`` query heads that share a kv head are laid out as G query rows of that head
    (``[B, Hkv, G, D]``), which is exact for a single-token step.

    Args:
        tokens, pos: ``[B]`` int64; ``window`` > max(pos).
    Returns:
        ``[B, V]`` float32 logits.
    """
    b = tokens.shape[0]
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    c, s = head_rope(cos[pos], sin[pos], spec)  # [B, Hall, D]
    index = cache.decode_index(pos)  # [B * 2Hkv]
    x = F.embedding(tokens, w.embed)  # [B, hidden]
    plan = cache.decode_plan(b, pos, window, x.dtype)  # the attention kernel's per-step data
    for layer, lw in enumerate(w.layers):
        qkv = _qkv(spec, lw, x, (b,), c, s)  # [B, Hall, D]
        cache.write(layer, index, qkv[:, h:])
        a = cache.attend(layer, qkv[:, :h].view(b, hkv, h // hkv, d), plan, d**-0.5)  # [B, Hkv, G, D]
        x = _residual_linear(x, a.reshape(b, -1), lw.o_w, lw.o_b, tp_group)
        x = _mlp(spec, lw, x, tp_group)
    return _logits(spec, w, x)
