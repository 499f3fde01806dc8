"""Matmul FLOPs per token of a dense decoder, for MFU and compute-roofline shares.

Convention (Megatron / PaLM, as verl's `flops_counter` for Qwen2/Llama):

* Dense part: 2 FLOPs per multiply-accumulate, so a token costs `2 * N` in the forward pass,
  where N counts the weights of every matmul a token goes through: per layer q/k/v/o
  projections and the gated MLP (gate, up, down), plus the LM head (`vocab * hidden`).
  The input embedding is a lookup, not a matmul, so it is not counted (verl counts it; that
  adds `2 * vocab * hidden` per token on their side). Biases and norms are left out.
* Attention: `Q K^T` and `P V` each cost `2 * seq * q_dim` per token and layer (q_dim =
  heads * head_dim), i.e. `4 * n_layers * seq * q_dim` for a token that attends to `seq`
  keys. With `causal=True` (the default), a token of a length-`seq_len` sequence attends on
  average to `seq_len / 2` keys, so the figure is halved to `2 * n_layers * seq_len * q_dim`:
  the work a causal flash-attention kernel actually does. PaLM's and verl's MFU use the
  un-halved figure (`causal=False`); pass it to compare with their numbers. For one decode
  step of a token whose context is `seq_len` long, use `causal=False` with that context.
* Training = 3 x forward (backward costs two matmuls per forward matmul: input and weight
  gradients). Activation recomputation is *not* counted: MFU measures useful model FLOPs.
"""

from __future__ import annotations


def _head_dim(cfg) -> int:
    head_dim = getattr(cfg, "head_dim", None)
    return int(head_dim) if head_dim else cfg.hidden_size // cfg.num_attention_heads


def matmul_params(hf_config) -> dict[str, int]:
    """Weights of the matmuls one token goes through: {"layers": ..., "lm_head": ...}.

    `hf_config` is a transformers config of a Llama/Qwen2-style model (hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    optional head_dim, vocab_size). A MoE of ``rlhf.models.moe_archs`` counts the experts a token is
    routed to and the router (verl's convention: ``3 * hidden * moe_intermediate * top_k + hidden *
    num_experts`` per sparse layer, plus Qwen2-MoE's shared expert and its gate); other
    mixture-of-experts configs are refused.
    """
    from rlhf.models.moe_archs import MOE_MODEL_TYPES

    if getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES:
        return _moe_matmul_params(hf_config)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(hf_config, key, None):
            raise ValueError(f"model_flops_per_token: mixture-of-experts config ({key}="
                             f"{getattr(hf_config, key)}) is not supported; dense decoders and "
                             f"{', '.join(MOE_MODEL_TYPES)} only")
    return _dense_matmul_params(hf_config)


def _dense_matmul_params(hf_config) -> dict[str, int]:
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    hd = _head_dim(hf_config)
    attn = h * heads * hd * 2 + h * kv_heads * hd * 2      # q and o; k and v (GQA)
    if hf_config.model_type == "deepseek_v3":  # MLA: low-rank q and kv, then the per-head up-projections, o
        c, qr = hf_config, hf_config.q_lora_rank
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q = h * qr + qr * heads * qk if qr else h * heads * qk
        attn = q + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (
            c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h
    mlp = 3 * h * hf_config.intermediate_size               # gate, up, down
    return {"layers": layers * (attn + mlp), "lm_head": hf_config.vocab_size * h}


def _moe_matmul_params(cfg) -> dict[str, int]:
    from rlhf.models.moe import MoESpec

    dense = _dense_matmul_params(cfg)
    h = cfg.hidden_size
    spec = MoESpec.from_config(cfg)
    sparse = sum(spec.sparse)
    # shared expert (+ Qwen2-MoE's gate; DeepSeek-V3's is ungated)
    shared = 3 * h * spec.shared_intermediate_size + h * (spec.scoring == "softmax") \
        if spec.shared_intermediate_size else 0
    routed = 3 * h * spec.intermediate_size * spec.top_k + h * spec.num_experts + shared
    mlp_dense = 3 * h * cfg.intermediate_size
    return {"layers": dense["layers"] - sparse * (mlp_dense - routed), "lm_head": dense["lm_head"]}


def model_flops_per_token(hf_config, seq_len: int, training: bool, *, causal: bool = True) -> float:
    """Model FLOPs for one token of a length-`seq_len` sequence (conventions in the module doc).

    forward = 2 * (N_layers + N_lm_head) + 4 * n_layers * seq_len * q_dim * (1/2 if causal);
    training = 3 * forward.
    """
    n = matmul_params(hf_config)
    q_dim = hf_config.num_attention_heads * _head_dim(hf_config)
    if hf_config.model_type == "deepseek_v3":  # scores over the qk dims, output over the v dims: their mean
        q_dim = hf_config.num_attention_heads * (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
                                                 + hf_config.v_head_dim) / 2
    attn = 4.0 * hf_config.num_hidden_layers * seq_len * q_dim
    if causal:
        attn /= 2
    fwd = 2.0 * (n["layers"] + n["lm_head"]) + attn
    return 3.0 * fwd if training else fwd


__all__ = ["matmul_params", "model_flops_per_token"]
