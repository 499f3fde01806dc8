"""GPT-OSS (transformers' ``GptOssForCausalLM``): what the family changes, and its pieces.

Checked against transformers 5.x ``modeling_gpt_oss.py``:

* **Attention sinks**: each attention layer has ``self_attn.sinks [H]``, a learned logit per query head
  that joins every softmax row's denominator and is then dropped (``p_j = exp(s_j) / (sum_i exp(s_i) +
  exp(sink_h))``). Every attention path takes it: explicit attention
  (:func:`rlhf.models.softcap_attention.attention` with ``sinks``) in the sampler's prefill and gather
  decode; in the trainer's packed / padded paths the sink is one more SDPA key
  (:func:`rlhf.models.softcap_attention.sink_sdpa`: no ``[T, T]`` scores); kernels that return the
  log-sum-exp of the row
  (flash-attn's paged decode, the cascade's merge) rescale their output by :func:`sink_scale`. Under tp
  the sinks are split with the query heads (dim 0).
* Alternating sliding-window / full layers (``layer_types``), q/k/v/o biases, YaRN rope (a static rope
  type: ``rlhf.models.arch.rope_inv_freq``).
* RMSNorm weights kept in fp32 and applied before the cast back (``_keep_in_fp32_modules``).
* Experts stored transposed with gate / up interleaved: ``mlp.experts.gate_up_proj [E, hidden, 2I]``
  (gate = even columns, up = odd), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, hidden]``,
  ``down_proj_bias [E, hidden]``. They run through :func:`rlhf.models.moe.experts` as transposed views
  (``interleaved=True``, biases added once per assignment): under tp and ep the experts stay whole on one
  rank, so each bias is added once.
* The clamped SwiGLU :func:`clamped_swiglu` (``alpha = swiglu_alpha``, ``limit = swiglu_limit``).
* The router ``mlp.router`` (weight ``[E, hidden]`` and a bias): top-k of the logits, softmax over the
  k, which equals the renormalised top-k of the full softmax (``norm_topk_prob``), so the shared
  routing, replay and statistics code serves it with the bias added.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

GPT_OSS_TYPES = ("gpt_oss",)


def is_gpt_oss(config: Any) -> bool:
    return getattr(config, "model_type", None) in GPT_OSS_TYPES


def swiglu_params(config: Any) -> tuple[float, float] | None:
    """``(alpha, limit)`` of GPT-OSS's clamped SwiGLU, None for the other families."""
    # older transformers (5.17) hard-code alpha = 1.702 in the model and have no config field for it
    return (float(getattr(config, "swiglu_alpha", 1.702)), float(config.swiglu_limit)) if is_gpt_oss(config) \
        else None


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)`` (HF's ``_apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def sink_scale(lse: Tensor, sinks: Tensor) -> Tensor:
    """The factor that turns a plain attention output into the sink one: ``sum exp(s) / (sum exp(s) +
    exp(sink)) = sigmoid(lse - sink)`` (fp32; ``lse`` and ``sinks`` broadcast to the rows' shape)."""
    return torch.sigmoid(lse.float() - sinks.float())


def local(t: Tensor | None) -> Tensor | None:
    """This rank's part of a parameter: the local shard of a DTensor (the trainer's tp-sharded sinks,
    ``Shard(0)`` with the heads; the experts' biases), a plain tensor as it is."""
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


def expert_layout(gate_up: Tensor, down: Tensor, gate_up_b: Tensor, down_b: Tensor) -> dict:
    """:func:`rlhf.models.moe.experts` arguments for GPT-OSS's stored experts (``gate_up [E, hidden, 2I]``
    with gate / up interleaved, ``down [E, I, hidden]``, biases): transposed views, no copy."""
    return dict(gate_up=gate_up.transpose(1, 2), down=down.transpose(1, 2), gate_up_b=gate_up_b, down_b=down_b,
                interleaved=True)


def experts_args(module: Any, gate_up: Tensor, down: Tensor, scale: Any = None) -> dict:
    """Keyword arguments of :func:`rlhf.models.moe.experts` for an HF experts module whose local weights
    are ``gate_up`` / ``down`` (plain tensors of this rank's experts). GPT-OSS: the transposed views, the
    biases (``scale``: the gradient scale applied to the weights, for expert parallelism) and the
    clamped SwiGLU; other families: their ``act_fn`` SwiGLU."""
    if not hasattr(module, "gate_up_proj_bias"):
        return dict(gate_up=gate_up, down=down, act=lambda g, u: module.act_fn(g) * u)
    bias = [local(module.gate_up_proj_bias), local(module.down_proj_bias)]
    if scale is not None:
        bias = [scale(b) for b in bias]
    alpha, limit = module.alpha, module.limit
    return dict(**expert_layout(gate_up, down, *bias), act=lambda g, u: clamped_swiglu(g, u, alpha, limit))
