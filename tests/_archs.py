"""Tiny random HF models of the architectures beyond Llama/Qwen2 (no downloads), for the tests.

Each config exercises what makes its family different: Gemma 2 with small soft-caps (so that
tanh is far from linear), a 4-token sliding window and ``query_pre_attn_scalar != head_dim``;
Gemma 3 with a local rope base and linear rope scaling on its global layer; Phi-3 with partial
rotary and a sliding window; Qwen3-MoE with a dense ``mlp_only_layers`` layer and normalised
top-k routing; Qwen2-MoE with its gated shared expert, un-normalised top-k, q/k/v biases, a dense
layer and sliding windows on two layers; Mixtral (top-2 renormalised) with a 6-token window; OLMoE
with its whole-projection q/k norms, ``clip_qkv`` and un-normalised top-2; GPT-OSS with large random
attention sinks (std 1: the sink takes a visible share of each row), a 4-token window on
alternating layers, random expert / router biases, a small SwiGLU ``limit`` (1.0, so the clamps bite)
and YaRN rope; DeepSeek-V3 with MLA (q and kv low-rank, nope/rope split, ``v_head_dim != qk_head_dim``,
interleaved rope, YaRN with ``mscale_all_dim``), sigmoid group-limited routing with a random selection bias,
a shared expert and a first dense layer. Norm weights are randomised (HF initialises Gemma's to 0, i.e. scale 1).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
ARCHS = ("gemma2", "gemma3", "phi3", *MOE_ARCHS)
_COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, initializer_range=0.1, max_position_embeddings=256,
               pad_token_id=0, eos_token_id=1, bos_token_id=None)


def tiny_config(kind: str, **overrides) -> transformers.PretrainedConfig:
    c = dict(_COMMON)
    if kind == "gemma2":
        c.update(query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        c.update(overrides)
        return transformers.Gemma2Config(**c)
    if kind == "gemma3":
        c.update(query_pre_attn_scalar=16, sliding_window=4, rope_local_base_freq=100.0,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                 rope_scaling={"rope_type": "linear", "factor": 2.0})
        c.update(overrides)
        return transformers.Gemma3TextConfig(**c)
    if kind == "phi3":
        c.pop("head_dim")
        c.update(partial_rotary_factor=0.5, sliding_window=6)
        c.update(overrides)
        return transformers.Phi3Config(**c)
    if kind == "qwen3_moe":
        c.update(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 mlp_only_layers=[1])
        c.update(overrides)
        return transformers.Qwen3MoeConfig(**c)
    if kind == "qwen2_moe":
        c.update(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                 shared_expert_intermediate_size=32, mlp_only_layers=[1], qkv_bias=True, use_sliding_window=True,
                 sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        c.update(overrides)
        return transformers.Qwen2MoeConfig(**c)
    if kind == "mixtral":
        c.update(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6)
        c.update(overrides)
        return transformers.MixtralConfig(**c)
    if kind == "olmoe":
        c.pop("head_dim")  # OLMoE's head dim is hidden / heads
        c.update(intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=0.5)
        c.update(overrides)
        return transformers.OlmoeConfig(**c)
    if kind == "gpt_oss":
        # a limit the tiny activations reach; older transformers (5.17) ignore the field (their model hard-codes 7.0)
        limit = 1.0 if hasattr(transformers.GptOssConfig(), "swiglu_alpha") else 7.0
        c.update(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4, swiglu_limit=limit,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
        c.update(overrides)
        return transformers.GptOssConfig(**c)
    if kind == "deepseek_v3":
        c.pop("head_dim")
        c.update(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                 moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                 rope_interleave=True, num_nextn_predict_layers=0,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                  "beta_fast": 32, "beta_slow": 1})
        c.update(overrides)
        return transformers.DeepseekV3Config(**c)
    raise KeyError(kind)


def tiny_model(kind: str, seed: int = 1234, **overrides) -> torch.nn.Module:
    """A random fp32 causal LM of ``kind`` in eval mode (eager attention for soft-capped Gemma 2)."""
    cfg = tiny_config(kind, **overrides)
    cfg._attn_implementation = "eager" if kind in ("gemma2", "gpt_oss") else "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif kind == "gpt_oss" and name.endswith(("sinks", "bias")):
                p.normal_(0.0, 1.0)  # HF initialises biases to 0 and sinks at 0.1 scale: make them matter
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias (HF initialises it to 0)
                b.normal_(0.0, 0.3)
    return model


def write_tiny_model(d: Path, kind: str, seed: int = 0) -> str:
    """``d`` as an HF directory (config + safetensors) of ``tiny_model(kind)``."""
    tiny_model(kind, seed).save_pretrained(d, safe_serialization=True)
    return str(d)
