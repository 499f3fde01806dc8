"""The model's sizes as the memory planner sees them, read from an HF config.json dict (no weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from rlhf.models.arch import vl_language_config_dict
from rlhf.schema.config import ConfigError

RANKS_PER_NODE = 8  # GPUs of one node: the ranks that load on one host at once

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM",
                           "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "GptOssForCausalLM",
                           "DeepseekV3ForCausalLM")
_MOE = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "GptOssForCausalLM",
        "DeepseekV3ForCausalLM")
_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024 ** 3


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _shared_expert_size(d: dict) -> int:
    """The shared expert's width: Qwen2-MoE's own field, or DeepSeek's ``n_shared_experts`` experts."""
    return int(d.get("shared_expert_intermediate_size") or 0) or \
        int(d.get("n_shared_experts") or 0) * int(d.get("moe_intermediate_size") or 0)


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a supported decoder read from an HF config.json dict.

    Per family: Gemma 2/3 have four RMSNorms per block (and Gemma 3 per-head q/k norms); Phi-3
    fuses q|k|v and gate|up (same counts, other module names); a MoE's sparse blocks hold
    ``num_experts`` experts of ``moe_intermediate_size`` (Mixtral, OLMoE: ``intermediate_size``) and a
    router, of which a token uses ``experts_per_tok`` (:meth:`num_active_params`), plus Qwen2-MoE's
    shared expert with its gate, which every token uses; OLMoE normalises the whole q and k
    projections (``q_norm [heads * head_dim]``); experts are split over tp like the rest. GPT-OSS: biased
    attention, a sink logit per head, experts and router with biases, every block sparse. DeepSeek-V3:
    multi-head latent attention (``mla``: low-rank q and kv projections with their norms) cached as the
    sampler caches it, decompressed per head at ``max(qk, v)`` wide; the first ``first_k_dense_replace``
    blocks dense; shared experts without a gate.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections have a bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm of q and k
    norms_per_layer: int = 2  # Gemma: 4 (sandwich norms)
    fused: bool = False  # Phi-3: qkv_proj / gate_up_proj
    num_experts: int = 0  # MoE (rlhf.models.moe_archs)
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: int = 0  # blocks with routed experts (the others keep the dense MLP)
    shared_expert_size: int = 0  # Qwen2-MoE: the shared expert's width (0: none)
    full_qk_norm: bool = False  # OLMoE: one RMSNorm over all heads of q and of k
    checkpoint_bytes: int = 4  # bytes per weight in the checkpoint files (config.json's dtype; bf16 = 2)
    sinks: bool = False  # GPT-OSS: one attention-sink logit per head
    expert_bias: bool = False  # GPT-OSS: biased experts and router
    shared_gate: bool = True  # Qwen2-MoE's shared expert has a one-output gate (DeepSeek's has none)
    # DeepSeek-V3 MLA: (q_lora_rank (0: a plain q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    mla: tuple[int, int, int, int, int] | None = None

    @classmethod
    def from_config_dict(cls, d: dict, source: str = "config.json") -> "ModelShape":
        d = vl_language_config_dict(d)  # a Qwen-VL: its language model (the vision tower is not counted)
        archs = d.get("architectures") or []
        arch = archs[0] if archs else f"model_type {d.get('model_type')!r}"
        # a causal LM of the generic rollout path (rlhf.models.generic) is planned as the Llama-shaped decoder
        # of its sizes: approximate where its blocks differ (extra norms, experts, MLA)
        if arch not in SUPPORTED_ARCHITECTURES and arch not in _causal_lm_classes():
            raise ConfigError(f"{source}: the memory planner does not know architecture {arch}; "
                              f"known: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            layers = int(d["num_hidden_layers"])
            moe = arch in _MOE
            skip, step = set(d.get("mlp_only_layers") or []), int(d.get("decoder_sparse_step") or 1)
            skip |= set(range(int(d.get("first_k_dense_replace") or 0)))  # DeepSeek: the first blocks are dense
            kv_heads, head_dim = int(d.get("num_key_value_heads") or heads), int(d.get("head_dim") or hidden // heads)
            mla = None
            if arch == "DeepseekV3ForCausalLM":
                mla = (int(d.get("q_lora_rank") or 0), int(d["kv_lora_rank"]), int(d["qk_nope_head_dim"]),
                       int(d["qk_rope_head_dim"]), int(d["v_head_dim"]))
                kv_heads, head_dim = heads, max(mla[2] + mla[3], mla[4])  # the sampler's decompressed cache heads
            return cls(architecture=arch, vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                       intermediate_size=int(d["intermediate_size"]), num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, mla=mla,
                       sinks=arch == "GptOssForCausalLM", expert_bias=arch == "GptOssForCausalLM",
                       shared_gate=arch != "DeepseekV3ForCausalLM",
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in _GEMMA)),
                       qkv_bias=arch in _QKV_BIAS or bool(d.get("attention_bias", False)),
                       o_bias=arch not in _QKV_BIAS and bool(d.get("attention_bias", False)),
                       mlp_bias=bool(d.get("mlp_bias", False)),
                       qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
                       full_qk_norm=arch == "OlmoeForCausalLM",
                       norms_per_layer=4 if arch in _GEMMA else 2, fused=arch == "Phi3ForCausalLM",
                       num_experts=int(d.get("num_experts") or d.get("n_routed_experts") or d["num_local_experts"])
                       if moe else 0,
                       experts_per_tok=int(d["num_experts_per_tok"]) if moe else 0,
                       moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]) if moe else 0,
                       shared_expert_size=_shared_expert_size(d) if moe else 0,
                       sparse_layers=sum(i not in skip and (i + 1) % step == 0 for i in range(layers)) if moe else 0,
                       checkpoint_bytes=DTYPE_BYTES.get(str(d.get("dtype") or d.get("torch_dtype")), 4))
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r} needed by the memory planner") from None

    @classmethod
    def from_model_dir(cls, path: str, key: str = "model.path") -> "ModelShape":
        from rlhf.models.loading import check_model_dir  # the entry scripts' message for a bad model.path

        f = check_model_dir(path, key) / "config.json"
        return cls.from_config_dict(json.loads(f.read_text()), source=str(f))

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.mla[2] + self.mla[3] if self.mla else self.head_dim)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self, dense_mlp: bool = True) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each ``nn.Linear`` of one decoder block (a sparse MoE
        block, ``dense_mlp=False``, has attention linears only: its experts are 3-D parameters)."""
        H, I = self.hidden_size, self.intermediate_size
        if self.mla:
            qr, kvr, nope, rope, v = self.mla
            q = {"q_a_proj": (H, qr), "q_b_proj": (qr, self.q_dim)} if qr else {"q_proj": (H, self.q_dim)}
            out = {**q, "kv_a_proj_with_mqa": (H, kvr + rope), "kv_b_proj": (kvr, self.num_heads * (nope + v)),
                   "o_proj": (self.num_heads * v, H)}
            return {**out, "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)} if dense_mlp else out
        if self.fused:
            out = {"qkv_proj": (H, self.q_dim + 2 * self.kv_dim), "o_proj": (self.q_dim, H)}
            return {**out, "gate_up_proj": (H, 2 * I), "down_proj": (I, H)} if dense_mlp else out
        out = {"q_proj": (H, self.q_dim), "k_proj": (H, self.kv_dim), "v_proj": (H, self.kv_dim),
               "o_proj": (self.q_dim, H)}
        return {**out, "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)} if dense_mlp else out

    def _attn_and_norm_params(self) -> int:
        n = sum(i * o for i, o in self.linears(dense_mlp=False).values())
        if self.mla:  # the q and kv latents' norms (DeepSeek-V3 has no attention biases)
            return n + (self.mla[0] + self.mla[1]) + self.norms_per_layer * self.hidden_size
        n += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden_size * self.o_bias
        qk = (self.q_dim + self.kv_dim) if self.full_qk_norm else 2 * self.head_dim * self.qk_norm
        return n + self.norms_per_layer * self.hidden_size + qk + self.num_heads * self.sinks

    def _dense_mlp_params(self) -> int:
        H, I = self.hidden_size, self.intermediate_size
        return 3 * H * I + (2 * I + H) * self.mlp_bias

    def _experts_params(self, experts: int) -> int:
        """``experts`` experts (gate, up, down) and the router of one sparse block (and the shared
        expert with its one-output gate, which every token uses)."""
        H, S, I = self.hidden_size, self.shared_expert_size, self.moe_intermediate_size
        shared = 3 * H * S + H * self.shared_gate if S else 0
        bias = (experts * (2 * I + H) + self.num_experts) * self.expert_bias  # GPT-OSS: experts' and router's
        return experts * 3 * H * I + self.num_experts * H + shared + bias

    def routed_expert_params(self) -> int:
        """The routed experts (gate, up, down) of one sparse block: what ep shards (not the router, not the
        shared expert)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params(self) -> int:
        """Parameters of the largest decoder block."""
        mlp = self._experts_params(self.num_experts) if self.sparse_layers else self._dense_mlp_params()
        return self._attn_and_norm_params() + mlp

    def decoder_params(self, active: bool = False) -> int:
        """All decoder blocks (``active``: only the experts a token is routed to)."""
        sparse = self._experts_params(self.experts_per_tok if active else self.num_experts)
        mlp = self.sparse_layers * sparse + (self.num_layers - self.sparse_layers) * self._dense_mlp_params()
        return self.num_layers * self._attn_and_norm_params() + mlp

    @property
    def mlp_width(self) -> int:
        """Intermediate activations of one token's MLP (MoE: over its routed experts)."""
        if not self.sparse_layers:
            return self.intermediate_size
        return self.experts_per_tok * self.moe_intermediate_size + self.shared_expert_size

    def fp8_kernel_params(self) -> int:
        """Weights an FP8 rollout keeps in e4m3 for the ``_scaled_mm`` decode (rlhf.models.decoder_weights): the
        dense attention projections (not MLA's) and the dense MLPs; experts and the rest are dequantized."""
        attn = 0 if self.mla else sum(i * o for i, o in self.linears(dense_mlp=False).values())
        return self.num_layers * attn + (self.num_layers - self.sparse_layers) * 3 * self.hidden_size * \
            self.intermediate_size

    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """LM head + final norm (the head is the embedding when tied)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.embed_params())

    def num_params(self) -> int:
        return self.embed_params() + self.decoder_params() + self.head_params()

    def largest_param(self) -> int:
        """Elements of the largest single weight (the embedding, a fused MLP matrix or a block's experts)."""
        mlp = self.intermediate_size * self.hidden_size * (2 if self.fused else 1)
        experts = self.num_experts * 2 * self.moe_intermediate_size * self.hidden_size
        return max(self.embed_params(), mlp, experts)

    def num_active_params(self) -> int:
        """Parameters one token goes through (MoE: routed experts only; dense: all)."""
        return self.embed_params() + self.decoder_params(active=True) + self.head_params()

    def lora_params_per_layer(self, rank: int, target_modules) -> int:
        linears = self.linears(dense_mlp=not self.sparse_layers)
        names = list(linears) if target_modules == "all-linear" else [str(t) for t in target_modules]
        return sum(rank * (i + o) for name, (i, o) in linears.items() if name in names)
