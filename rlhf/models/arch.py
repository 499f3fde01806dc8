"""Architecture variants of the rollout decoder: what differs between the supported HF families.

``SUPPORTED_MODEL_TYPES`` is THE list of HF ``model_type`` values the sampler runs (the TP plan,
``rlhf.models.tensor_parallel``, reads it; the memory planner covers the same families).
:class:`ArchSpec` holds, read once from an HF config, everything a family changes relative to
the Llama block of ``rlhf.models.decoder``; the decoder calls the helpers below at a handful of
dispatch points:

=================  =====================================================================
family             differences (checked against transformers 5.x modeling code)
=================  =====================================================================
llama / mistral /  none (qwen2: q/k/v bias; qwen3: per-head q/k RMSNorm); sliding windows
qwen2 / qwen3      on the layers ``layer_types`` marks ``sliding_attention`` (mistral: all)
gemma2             embeddings x sqrt(hidden) (in the embedding dtype); RMSNorm scale
                   ``1 + w`` applied in fp32; norms on the attention and MLP *outputs* too
                   (sandwich); GeGLU (gelu tanh); softmax scale ``query_pre_attn_scalar**-0.5``;
                   attention-logit and final-logit tanh soft-capping; alternating
                   sliding-window / global layers
gemma3_text        Gemma 2 minus attention soft-capping, plus per-head q/k norms (``1 + w``),
                   a second rope table for the sliding layers (``rope_local_base_freq``,
                   no scaling) while global layers use the scaled one
phi3               fused ``qkv_proj`` / ``gate_up_proj`` (loaded as they are: the decoder fuses
                   q|k|v and gate|up anyway), partial rotary (``partial_rotary_factor``),
                   ``longrope`` scaling (short factors: ``max_seq_len`` must stay within
                   ``original_max_position_embeddings``), sliding window on every layer
qwen3_moe          Qwen3 attention; sparse MLP layers (``rlhf.models.moe``) with a top-k
                   softmax router, except ``mlp_only_layers`` and layers off
                   ``decoder_sparse_step``, which keep the dense MLP
qwen2_moe /        the other MoE families: ``rlhf.models.moe_archs`` (Qwen2-MoE's shared expert,
mixtral / olmoe    Mixtral's renormalised top-k, OLMoE's whole-projection q/k norm and clip_qkv)
gpt_oss            ``rlhf.models.gpt_oss``: attention sinks, alternating sliding / full layers,
                   fp32 norm weights, transposed interleaved experts with biases, clamped SwiGLU
deepseek_v3        multi-head latent attention (``rlhf.models.mla``), sigmoid group-limited router and
                   ungated shared experts (``rlhf.models.deepseek_v3``)
=================  =====================================================================

Attention: :func:`attend` is the one attention function of the decoder. Its per-layer
parameters (:class:`LayerAttn`: softmax scale, soft-cap, sliding window) change the math, and
:class:`Masks` builds each distinct mask once per forward. SDPA has no soft-cap, so a capped
layer runs the explicit ``softmax(cap * tanh(q k^T * scale / cap))`` of
:func:`rlhf.models.softcap_attention.attention`. Sliding windows only mask: the paged KV cache
still keeps every position of a sliding layer (no ring buffer, no memory saved).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.models.gpt_oss import GPT_OSS_TYPES, clamped_swiglu, swiglu_params
from rlhf.models.moe import MoESpec
from rlhf.models.moe_archs import FULL_QK_NORM_TYPES, MOE_MODEL_TYPES, check_config
from rlhf.models.softcap_attention import attention as capped_attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", *MOE_MODEL_TYPES)
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_GEMMA = ("gemma2", "gemma3_text")
# families whose sliding window (when set) applies to every layer rather than per ``layer_types``
_WINDOW_ALL_LAYERS = ("mistral", "phi3", "qwen3_moe", "mixtral")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class LayerAttn:
    """Attention settings of one layer."""

    scale: float  # softmax scale
    softcap: float | None  # tanh soft-cap of the attention logits (Gemma 2)
    window: int | None  # sliding window: a query at p sees keys p - window < k <= p
    rope: int  # row of the stacked rope tables (Gemma 3: local vs global)
    sinks: Tensor | None = field(default=None, compare=False)  # GPT-OSS: [H] sink logits (weights: with_sinks)


@dataclass(frozen=True)
class ArchSpec:
    """What a family changes in the Llama block (see the module table)."""

    embed_scale: float | None  # Gemma: sqrt(hidden), rounded to the embedding dtype
    norm_plus_one: bool  # Gemma: RMSNorm weight is (1 + w), applied in fp32
    sandwich_norms: bool  # Gemma: RMSNorm on the attention / MLP outputs before the residual add
    act: str  # "silu" or "gelu_tanh"
    final_softcap: float | None  # tanh soft-cap of the LM-head logits (Gemma 2)
    fused_qkv: bool  # Phi-3 checkpoint names: qkv_proj / gate_up_proj
    rotary_dim: int  # rotated leading dims of a head (Phi-3 partial rotary)
    rope_max_len: int | None  # longrope: longest sequence the short factors serve
    layers: tuple[LayerAttn, ...]
    moe: MoESpec | None  # MoE families: the routed MLP
    full_qk_norm: bool = False  # OLMoE: q / k RMSNorm over the whole projection (rlhf.models.moe_archs)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-c, c] after the norms
    swiglu: tuple[float, float] | None = None  # GPT-OSS: (alpha, limit) of the clamped SwiGLU
    norm_fp32: bool = False  # GPT-OSS: RMSNorm weights kept in fp32, applied before the cast back
    rope_interleave: bool = False  # DeepSeek-V3: rotary dims in pairs (rlhf.models.mla permutes the weights)


# Vision-language families whose language model the sampler runs -> its text family (the vision tower
# runs beside it at prefill: rlhf.rollout.vision)
VL_TEXT_FAMILY = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}


def vl_text_config(config: Any) -> Any:
    """A supported Qwen-VL config's language model config, read as its text family (a copy)."""
    import copy

    text = copy.copy(config.text_config)
    text.model_type = VL_TEXT_FAMILY[config.model_type]
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def vl_language_config_dict(d: dict) -> dict:
    """A Qwen-VL ``config.json`` dict -> its language model's, as the text causal LM it is read as (the
    top-level keys of the older layout, overridden by ``text_config``); any other dict as it is."""
    if d.get("model_type") not in VL_TEXT_FAMILY:
        return d
    text = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
    text.update(d.get("text_config") or {})
    family = VL_TEXT_FAMILY[d["model_type"]]
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    return {**text, "model_type": family, "architectures": [arch],
            "tie_word_embeddings": d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def check_model_type(config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = " (Gemma 3 multimodal checkpoints: only the text model, gemma3_text)" if model_type == "gemma3" else ""
        if model_type in VL_TEXT_FAMILY:
            hint = f" (a {model_type} config goes to the sampler whole: its text_config is read there)"
        elif not hint and getattr(config, "vision_config", None) is not None:
            hint = f" (vision-language: the sampler runs {', '.join(VL_TEXT_FAMILY)})"
        raise NotImplementedError(
            f"rollout sampler: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
        )
    return model_type


def _rope_params(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers < 5
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _per_layer_type(params: dict) -> bool:
    return "full_attention" in params and "rope_theta" not in params  # Gemma 3: one dict per layer type


def _layer_rope_params(config: Any) -> list[dict]:
    """Rope parameters of each rope table: global layers', then (Gemma 3) sliding layers'."""
    params = _rope_params(config)
    return [params["full_attention"], params["sliding_attention"]] if _per_layer_type(params) else [params]


def _rope_index(config: Any, layer: int) -> int:
    """The rope table of ``layer`` (a row of :func:`_layer_rope_params`)."""
    return int(_per_layer_type(_rope_params(config)) and config.layer_types[layer] == "sliding_attention")


def from_config(config: Any, head_dim: int) -> ArchSpec:
    """The :class:`ArchSpec` of an HF config (``model_type`` already checked)."""
    model_type = config.model_type
    gemma = model_type in _GEMMA
    act_name = getattr(config, "hidden_activation", None) if gemma else getattr(config, "hidden_act", "silu")
    act = _ACTIVATIONS.get(act_name or "silu")
    if act is None:
        raise NotImplementedError(f"rollout sampler: hidden activation {act_name!r} of {model_type} is not supported "
                                  f"(only {', '.join(_ACTIVATIONS)})")
    check_config(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"rollout sampler: {model_type} with use_bidirectional_attention is not a causal LM")
    scale = config.query_pre_attn_scalar ** -0.5 if gemma else head_dim ** -0.5
    if model_type == "deepseek_v3":
        from rlhf.models.mla import softmax_scale

        scale = softmax_scale(config)
    # Gemma 3 keeps attn_logit_softcapping in its config but its attention never applies it.
    softcap = getattr(config, "attn_logit_softcapping", None) if model_type == "gemma2" else None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    layers = []
    for i in range(config.num_hidden_layers):
        sliding = model_type in _WINDOW_ALL_LAYERS or layer_types[i] == "sliding_attention"
        layers.append(LayerAttn(scale=scale, softcap=softcap, window=window if sliding else None,
                                rope=_rope_index(config, i)))
    rope_max_len = None
    params = _rope_params(config)
    if params.get("rope_type") == "longrope":
        rope_max_len = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    return ArchSpec(
        embed_scale=math.sqrt(config.hidden_size) if gemma else None,
        norm_plus_one=gemma,
        sandwich_norms=gemma,
        act=act,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        fused_qkv=model_type == "phi3",
        rotary_dim=rotary_dim(config, head_dim),
        rope_max_len=rope_max_len,
        layers=tuple(layers),
        moe=MoESpec.from_config(config) if model_type in MOE_MODEL_TYPES else None,
        full_qk_norm=model_type in FULL_QK_NORM_TYPES,
        clip_qkv=getattr(config, "clip_qkv", None) if model_type in FULL_QK_NORM_TYPES else None,
        swiglu=swiglu_params(config),
        norm_fp32=model_type in GPT_OSS_TYPES,
        rope_interleave=model_type == "deepseek_v3" and bool(getattr(config, "rope_interleave", True)),
    )


def check_seq_len(arch: ArchSpec, model_type: str, max_seq_len: int) -> None:
    """Refuse lengths whose rope the sampler would get wrong (longrope's long factors)."""
    if arch.rope_max_len is not None and max_seq_len > arch.rope_max_len:
        raise NotImplementedError(
            f"rollout sampler: {model_type} uses longrope scaling, whose long factors (sequences over "
            f"original_max_position_embeddings={arch.rope_max_len}) are not supported; max_seq_len={max_seq_len} "
            "exceeds it: lower data.max_prompt_length + data.max_response_length")


# --------------------------------------------------------------------------- rope


def rotary_dim(config: Any, head_dim: int) -> int:
    """Rotated leading dims of a head: Phi-3's ``partial_rotary_factor``, DeepSeek-V3's ``qk_rope_head_dim``
    (the other families rotate all)."""
    if config.model_type == "deepseek_v3":
        return config.qk_rope_head_dim
    if config.model_type != "phi3":
        return head_dim
    return int(head_dim * _rope_params(config).get("partial_rotary_factor", 1.0))


def rope_inv_freq(config: Any, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """HF's inverse frequencies ``[K, rotary_dim // 2]`` (float32) and cos/sin scales ``[K]``,
    one row per rope table (K = 2 for Gemma 3: global layers, then sliding layers)."""
    invs, scales = [], []
    tables = _layer_rope_params(config)
    for i, params in enumerate(tables):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base = params["rope_theta"]
            inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
            invs.append(inv)
            scales.append(1.0)
            continue
        if rope_type not in _STATIC_ROPE_TYPES:
            raise NotImplementedError(
                f"rollout sampler: rope_type {rope_type!r} of {config.model_type} is not supported; "
                f"supported: {', '.join(_STATIC_ROPE_TYPES)}"
            )
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kw = {"layer_type": ("full_attention", "sliding_attention")[i]} if len(tables) > 1 else {}
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kw)
        invs.append(inv.float())
        scales.append(float(scale))
    return torch.stack(invs), torch.tensor(scales, dtype=torch.float32)


# --------------------------------------------------------------------------- norms, embedding, MLP, logits


def norm_weight(arch: ArchSpec, w: Tensor) -> Tensor:
    """A loaded RMSNorm weight in the form ``decoder.rms_norm`` applies: Gemma's ``1 + w`` kept in
    fp32 (its scale is applied before the cast back), others as given."""
    return 1.0 + w.float() if arch.norm_plus_one else w.float() if arch.norm_fp32 else w


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


def embed(arch: ArchSpec, table: Tensor, ids: Tensor) -> Tensor:
    x = F.embedding(ids, table)
    if arch.embed_scale is not None:
        # HF rounds the scale to the embedding dtype first; a Python scalar of that rounded value gives
        # the same product and, unlike a fresh device tensor, is allowed inside CUDA-graph capture
        x = x * _rounded(arch.embed_scale, x.dtype)
    return x


def gated_act(arch: ArchSpec, gate: Tensor, up: Tensor, inplace: bool = False) -> Tensor:
    """``act(gate) * up``: SwiGLU or GeGLU (tanh-approximated gelu, ``gelu_pytorch_tanh``). ``inplace``
    (a caller that owns ``gate`` and records no autograd graph): the result is written into ``gate``."""
    if arch.swiglu is not None:
        return clamped_swiglu(gate, up, *arch.swiglu)
    if arch.act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if inplace:  # no [M, I] activation / product tensors: fresh pages per MLP at decode sizes
        return F.silu(gate, inplace=True).mul_(up)
    return F.silu(gate) * up


def softcap_logits(arch: ArchSpec, logits: Tensor) -> Tensor:
    """Final-logit soft-cap ``cap * tanh(logits / cap)``, in the logits' dtype like HF."""
    cap = arch.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


# --------------------------------------------------------------------------- attention


class Masks:
    """The attention masks of one forward, built once per distinct sliding window.

    Keys are cache positions ``0 .. kv_len - 1``. ``q_pos`` (broadcastable to the query rows,
    e.g. ``[c]`` for a chunk or ``[B, 1, 1]`` for a decode step) are the query positions;
    ``None`` means a square causal grid (query ``i`` at position ``i``), which needs no mask
    tensor at all unless a window is set.
    """

    def __init__(self, q_pos: Tensor | None, kv_len: int, device: torch.device) -> None:
        self.q_pos, self.kv_len, self.device = q_pos, kv_len, device
        self._cache: dict[int | None, Tensor | None] = {}

    def get(self, window: int | None) -> Tensor | None:
        """Bool mask (True = attend) broadcastable to the scores, or None for plain causal."""
        if window not in self._cache:
            if self.q_pos is None and (window is None or window >= self.kv_len):
                self._cache[window] = None
            else:
                k = torch.arange(self.kv_len, device=self.device)
                q = torch.arange(self.kv_len, device=self.device) if self.q_pos is None else self.q_pos
                q = q[..., None]
                mask = k <= q
                if window is not None:
                    mask = mask & (k > q - window)
                self._cache[window] = mask
        return self._cache[window]


def attend(q: Tensor, k: Tensor, v: Tensor, masks: Masks, p: LayerAttn) -> Tensor:
    """Attention of one layer: ``q [..., Hq, Tq, D]``, ``k, v [..., Hkv, Tk, D]`` -> ``[..., Hq, Tq, D]``.

    Grouped-query attention when ``Hq > Hkv`` (query head ``h`` reads kv head ``h // (Hq / Hkv)``).
    """
    mask = masks.get(p.window)
    gqa = q.shape[-3] != k.shape[-3]
    if p.softcap is None and p.sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=p.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.scale, enable_gqa=gqa)
    if mask is None:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    sinks = p.sinks
    if sinks is not None and sinks.shape[0] != q.shape[-3]:  # query heads folded into rows (chunked prefill)
        h, rows = q.shape[-3], q.shape[-2]
        g = sinks.shape[0] // h  # row j * c + i is query i of member j of its kv head
        sinks = sinks.view(h, g, 1).expand(h, g, rows // g).reshape(h, rows)
    return capped_attention(q, k, v, mask, scale=p.scale, softcap=p.softcap, sinks=sinks)


def with_sinks(p: LayerAttn, sinks: Tensor | None) -> LayerAttn:
    """``p`` carrying a layer's sink logits (GPT-OSS, this rank's heads) to the attention kernels."""
    return p if sinks is None else replace(p, sinks=sinks)
