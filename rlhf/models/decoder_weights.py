"""The sampler's weights: HF-named tensors moved, cast and fused into one :class:`DecoderWeights`
(q|k|v and gate|up in one matmul each, norms in the form ``rms_norm`` applies, each family's extra
tensors: MoE routers and experts, GPT-OSS's sinks and biases, DeepSeek-V3's latent projections).
The forward that reads them is ``rlhf.models.decoder``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from rlhf.models import arch, fp8, mla
from rlhf.models.gpt_oss import expert_layout


@dataclass
class LayerWeights:
    """One decoder layer, with fused projections (``[out, in]`` like ``nn.Linear``).

    Norm weights are in the form ``rms_norm`` applies (``arch.norm_weight``: Gemma's ``1 + w`` in fp32).
    """

    input_norm: Tensor  # [hidden]
    qkv_w: Tensor  # [(H + 2 Hkv) * D, hidden]
    qkv_b: Tensor | None
    qk_norm: Tensor | None  # [H + Hkv, D] (qwen3 / gemma3): q_norm weight on q heads, k_norm on k heads
    o_w: Tensor  # [hidden, H * D]
    o_b: Tensor | None
    post_norm: Tensor  # [hidden] the norm before the MLP (Gemma: pre_feedforward_layernorm)
    gate_up_w: Tensor | None  # [2 * I, hidden] (None in a MoE layer)
    gate_up_b: Tensor | None
    down_w: Tensor | None  # [hidden, I]
    down_b: Tensor | None
    attn_out_norm: Tensor | None = None  # Gemma: post_attention_layernorm on the attention output
    mlp_out_norm: Tensor | None = None  # Gemma: post_feedforward_layernorm on the MLP output
    router_w: Tensor | None = None  # MoE: [E, hidden]
    experts_gate_up: Tensor | None = None  # MoE: [E_local, 2 * I_moe, hidden]
    experts_down: Tensor | None = None  # MoE: [E_local, hidden, I_moe]
    shared_gate_up: Tensor | None = None  # Qwen2-MoE shared expert: [2 * I_s, hidden]
    shared_down: Tensor | None = None  # [hidden, I_s]
    shared_gate: Tensor | None = None  # [1, hidden]
    q_norm_full: Tensor | None = None  # OLMoE: [H * D] over the whole q projection (full, not sliced)
    k_norm_full: Tensor | None = None  # [Hkv * D]
    sinks: Tensor | None = None  # GPT-OSS: [H] attention sink logits (rlhf.models.gpt_oss)
    router_b: Tensor | None = None  # GPT-OSS: [E] router bias
    experts_gate_up_b: Tensor | None = None  # GPT-OSS: [E_local, 2 * I] (experts stored [E, hidden, 2I], interleaved)
    experts_down_b: Tensor | None = None  # GPT-OSS: [E_local, hidden]
    select_bias: Tensor | None = None  # DeepSeek-V3: e_score_correction_bias [E] (expert selection only)
    mla_a_w: Tensor | None = None  # DeepSeek-V3 MLA (rlhf.models.mla.layer_weights): q_a | kv_a fused
    mla_a_b: Tensor | None = None
    mla_q_norm: Tensor | None = None
    mla_q_w: Tensor | None = None  # q_b_proj (or q_proj), rope rows first per head
    mla_kv_norm: Tensor | None = None
    mla_kv_b_w: Tensor | None = None


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


def _qk_norm_table(spec: Any, q: Tensor | None, k: Tensor | None) -> Tensor | None:
    if q is None or k is None:
        return None
    return torch.cat((q.expand(spec.num_heads, -1), k.expand(spec.num_kv_heads, -1))).contiguous()


def _readers(spec: Any, weights: Mapping[str, Tensor], missing: list[str], *, device: torch.device | None,
             dtype: torch.dtype | None, consume: bool = False, copy: bool = False, keep_grad: bool = False):
    """``get(name, required, as_dtype, kernel)``, ``cat(*ts)`` and ``norm_w(name)`` over ``weights``: the reads
    :func:`prepare_weights` makes (missing required names go to ``missing``). ``keep_grad``: the tensors
    stay in the autograd graph (a trainer's live parameters; no move or cast). ``kernel``: an FP8 dense
    projection stays :class:`rlhf.models.fp8.Fp8Weight` where the FP8 matmul runs (else dequantized)."""
    take = weights.pop if consume else weights.get  # type: ignore[attr-defined]

    def get(name: str, required: bool = True, as_dtype: torch.dtype | None = None,
            kernel: bool = False) -> Tensor | fp8.Fp8Weight | None:
        t = take(name, None)
        if t is None:
            if required:
                missing.append(name)
            return None
        if keep_grad:
            return t if as_dtype is None else t.to(as_dtype)
        if t.dtype == fp8.FP8:
            s = take(fp8.scale_name(name), None)
            if s is None:
                missing.append(fp8.scale_name(name))
                return None
            w = fp8.Fp8Weight(t.detach().to(device=device, copy=copy), s.detach().to(device=device, copy=copy), dtype)
            if kernel and fp8.kernel_ok(torch.device(device), w.scheme, dtype) and fp8.runs_kernel(w):
                return w
            return w.dequantize().to(as_dtype or dtype)
        return t.detach().to(device=device, dtype=as_dtype or dtype, copy=copy)

    def cat(*ts: Tensor | fp8.Fp8Weight | None) -> Tensor | fp8.Fp8Weight | None:
        if any(t is None for t in ts):
            return None
        if all(isinstance(t, fp8.Fp8Weight) for t in ts):
            fused = fp8.Fp8Weight.cat(list(ts))  # type: ignore[arg-type]
            if fused is not None and fp8.runs_kernel(fused):
                return fused
        ts = tuple(t.dequantize() if isinstance(t, fp8.Fp8Weight) else t for t in ts)
        return torch.cat(ts, dim=0).contiguous()  # type: ignore[arg-type]

    def norm_w(name: str) -> Tensor | None:
        t = get(name)
        return None if t is None else arch.norm_weight(spec.arch, t)

    return get, cat, norm_w


def _layer(spec: Any, i: int, get, cat, norm_w) -> LayerWeights:
    """Layer ``i``'s fused weights read through ``_readers``."""
    fused, moe_spec, gemma = spec.arch.fused_qkv, spec.arch.moe, spec.arch.sandwich_norms
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    q_b = get(a + "q_proj.bias", required=False)
    sparse = moe_spec is not None and moe_spec.sparse[i]
    shared = sparse and moe_spec.shared_intermediate_size > 0
    oss = sparse and spec.arch.swiglu is not None  # GPT-OSS: mlp.router, expert biases
    dense = not sparse and not fused
    latent = {} if spec.mla is None else mla.layer_weights(get, a, spec.mla, spec.arch.rope_interleave)
    sx = "shared_experts." if spec.mla is not None else "shared_expert."  # DeepSeek-V3: ungated, plural

    def kget(name: str) -> Tensor | fp8.Fp8Weight | None:
        """A dense projection: kept in FP8 for the kernel where it runs."""
        return get(name, kernel=True)

    return LayerWeights(
        input_norm=norm_w(p + "input_layernorm.weight"),
        qkv_w=None if latent else kget(a + "qkv_proj.weight") if fused
        else cat(kget(a + "q_proj.weight"), kget(a + "k_proj.weight"), kget(a + "v_proj.weight")),
        qkv_b=None if q_b is None else cat(q_b, get(a + "k_proj.bias"), get(a + "v_proj.bias")),
        qk_norm=_qk_norm_table(spec, norm_w(a + "q_norm.weight"), norm_w(a + "k_norm.weight"))
        if spec.qk_norm
        else None,
        o_w=kget(a + "o_proj.weight") if not latent else get(a + "o_proj.weight"),
        o_b=get(a + "o_proj.bias", required=False),
        post_norm=norm_w(p + ("pre_feedforward" if gemma else "post_attention") + "_layernorm.weight"),
        gate_up_w=kget(m + "gate_up_proj.weight") if fused
        else cat(kget(m + "gate_proj.weight"), kget(m + "up_proj.weight")) if dense else None,
        gate_up_b=cat(get(m + "gate_proj.bias", False), get(m + "up_proj.bias", False)) if dense else None,
        down_w=None if sparse else kget(m + "down_proj.weight"),
        down_b=get(m + "down_proj.bias", required=False) if dense else None,
        attn_out_norm=norm_w(p + "post_attention_layernorm.weight") if gemma else None,
        mlp_out_norm=norm_w(p + "post_feedforward_layernorm.weight") if gemma else None,
        router_w=get(m + ("router" if oss else "gate") + ".weight", as_dtype=torch.float32 if latent else None)
        if sparse else None,
        experts_gate_up=get(m + "experts.gate_up_proj") if sparse else None,
        experts_down=get(m + "experts.down_proj") if sparse else None,
        shared_gate_up=cat(get(m + sx + "gate_proj.weight"), get(m + sx + "up_proj.weight"))
        if shared else None,
        shared_down=get(m + sx + "down_proj.weight") if shared else None,
        shared_gate=get(m + "shared_expert_gate.weight") if shared and not latent else None,
        q_norm_full=get(a + "q_norm.weight") if spec.arch.full_qk_norm else None,
        k_norm_full=get(a + "k_norm.weight") if spec.arch.full_qk_norm else None,
        sinks=get(a + "sinks") if spec.arch.norm_fp32 else None,
        router_b=get(m + "router.bias") if oss else None,
        experts_gate_up_b=get(m + "experts.gate_up_proj_bias") if oss else None,
        experts_down_b=get(m + "experts.down_proj_bias") if oss else None,
        select_bias=get(m + "gate.e_score_correction_bias", True, torch.float32) if sparse and latent else None,
        **latent,
    )


def layer_weights(spec: Any, i: int, params: Mapping[str, Tensor]) -> LayerWeights:
    """Layer ``i``'s :class:`LayerWeights` from its live parameters ``params`` (names relative to the layer,
    e.g. ``self_attn.q_proj.weight``), kept in the autograd graph: the fused q|k|v and gate|up are
    differentiable concatenations (rlhf.models.batch_invariant runs the trainer's forward through them)."""
    missing: list[str] = []
    prefix = f"model.layers.{i}."
    named = {prefix + k: v for k, v in params.items()}
    get, cat, norm_w = _readers(spec, named, missing, device=None, dtype=None, keep_grad=True)
    out = _layer(spec, i, get, cat, norm_w)
    if missing:
        raise KeyError(f"layer {i} of {spec.model_type}: missing {', '.join(missing[:8])}; got {', '.join(params)}")
    return out


def prepare_weights(
    spec: Any, weights: Mapping[str, Tensor], *, device: torch.device, dtype: torch.dtype,
    consume: bool = False, copy: bool = False, into: DecoderWeights | None = None,
) -> DecoderWeights:
    """Move / cast the HF-named weights and fuse q|k|v and gate|up; raise listing missing names.
    ``spec``: the model's ``rlhf.models.decoder.DecoderSpec``.

    Memory: tensors already on ``device`` in ``dtype`` are used as they are (no copy) unless
    ``copy``; the fused ones are new. ``consume``: ``weights`` is a dict the caller hands over;
    each tensor is popped from it as it is used, so the unfused tensors die while the fused
    ones are built (peak ~1x + one layer instead of 1x + every fused copy). ``into``: copy the
    result into these weights' tensors layer by layer (their storage kept: captured CUDA graphs
    read it) instead of returning new ones; peak + one layer.

    FP8 rollout weights (float8 tensors with their ``fp8.scale_name`` scales, rollout.quantization):
    the dense projections (q|k|v, o, gate|up, down) stay :class:`rlhf.models.fp8.Fp8Weight` where
    ``fp8.kernel_ok`` says the device runs the FP8 matmul; every other quantized weight, and all of
    them elsewhere (CPU, GPUs before sm89), is dequantized here into ``dtype``: the same numbers.
    """
    missing: list[str] = []
    get, cat, norm_w = _readers(spec, weights, missing, device=device, dtype=dtype, consume=consume, copy=copy)
    layers: list[LayerWeights] = []
    for i in range(spec.num_layers):
        layers.append(_layer(spec, i, get, cat, norm_w))
        if into is not None and not missing:  # this layer goes into the old buffers; the new copy dies
            layers[-1] = _copy_into(into.layers[i], layers[-1])
    embed = get("model.embed_tokens.weight")
    norm = norm_w("model.norm.weight")
    lm_head = get("lm_head.weight", required=not spec.tie_word_embeddings)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        given = ", ".join(list(weights)[:4])
        raise KeyError(f"rollout sampler: weights for {spec.model_type} are missing {shown}; got keys like {given}")
    out = DecoderWeights(embed=embed, layers=layers, norm=norm, lm_head=embed if lm_head is None else lm_head)
    return out if into is None else _copy_into(into, out)


def expert_weights(lw: LayerWeights) -> tuple[Tensor, Tensor, dict]:
    """A sparse layer's ``(gate_up, down, extra kwargs)`` in :func:`rlhf.models.moe.experts`' layout."""
    if lw.experts_gate_up_b is None:
        return lw.experts_gate_up, lw.experts_down, {}
    kw = expert_layout(lw.experts_gate_up, lw.experts_down, lw.experts_gate_up_b, lw.experts_down_b)  # GPT-OSS
    return kw.pop("gate_up"), kw.pop("down"), kw
