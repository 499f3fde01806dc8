"""Tensor parallelism (Megatron-style) for HF decoder-only LMs via DTensor plans.

Plan per decoder block (``parallelize_module`` on the 1-D tp mesh)::

    self_attn.{q,k,v}_proj   ColwiseParallel   -> each rank owns heads/tp (kv_heads/tp)
    self_attn.o_proj         RowwiseParallel   -> partial sums all-reduced
    self_attn.{q,k}_norm     replicated weight, grads summed over tp (Qwen3 per-head norms)
    mlp.{gate,up}_proj       ColwiseParallel   -> intermediate/tp columns
    mlp.down_proj            RowwiseParallel

Families beyond Llama / Qwen2 / Qwen3 / Mistral (``_family_plan``):

* Gemma 2 / Gemma 3: the same projections; Gemma 3's per-head q/k norms run on
  ``[b, heads, T, hd]`` (heads on dim 1, Qwen3's on dim 2); the extra norms stay replicated.
* Phi-3: ``qkv_proj`` and ``gate_up_proj`` are fused, and the HF forward slices them by the
  *global* head / intermediate sizes, so a row shard of them is not a set of whole heads.
  transformers' own Phi-3 plan is used: the fused projections are column-parallel with the
  output gathered (``Replicate``), attention and the gate run on all heads / columns on every
  rank, and ``o_proj`` / ``down_proj`` are row-parallel on a replicated input (a local slice).
  Parameters and projection FLOPs are split; attention is not, and each block all-gathers
  the fused outputs. (A faster plan would need the fused weights stored head-interleaved.)
* Qwen3-MoE: experts over tp (:class:`ExpertsOverTP`): each rank holds ``num_experts / tp``
  whole experts (``mlp.experts.gate_up_proj`` / ``down_proj`` split on dim 0), the router
  ``mlp.gate`` is replicated. Tokens are replicated over tp already, so no all-to-all is
  needed: each rank runs its experts on the tokens routed to them and the partial outputs are
  all-reduced, like a row-parallel ``down_proj``. Why not each expert's gate/up by rows and
  down by columns: HF stores gate|up fused per expert (``[E, 2I, H]``), the Phi-3 problem
  again, and tiny per-expert matmuls split tp ways waste the GPU. Dense layers
  (``mlp_only_layers``) use the dense plan. Experts must divide by tp; the load balance
  follows the router. Qwen2-MoE / Mixtral / OLMoE the same (``rlhf.models.moe_archs``); Qwen2-MoE's
  shared expert is a dense MLP (column / row parallel) and its sigmoid gate stays replicated.
* GPT-OSS: experts over tp as Qwen3-MoE (transposed, interleaved, with biases: ``rlhf.models.gpt_oss``);
  the router ``mlp.router`` replicated; the attention sinks ``self_attn.sinks [H]`` split with the
  query heads (``Shard(0)``), read by the project's attention (``rlhf.models.varlen_attention``, set
  here whatever ``attn_implementation`` was: HF's eager one cannot take the local part of a DTensor).
* DeepSeek-V3 (MLA, ``rlhf.models.mla``): heads split by ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj``
  column-parallel, ``o_proj`` row-parallel; the low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their
  norms stay replicated (every rank needs the whole latent); shared experts column / row parallel.
* OLMoE: q_norm / k_norm normalise the WHOLE q / k projection of a token, so q/k/v_proj are
  column-parallel with the output gathered and o_proj row-parallel on a replicated input (Phi-3's plan).

and for the ends of the model::

    model.embed_tokens       RowwiseParallel(input Replicate)  vocab-parallel embedding
    lm_head                  ColwiseParallel, output Shard(-1) when loss_parallel
                             (log-probs via rlhf.models.vocab_parallel, never gathered),
                             else output Replicate (full logits on every rank)

HF attention modules reshape projections with ``view(*shape, -1, head_dim)`` and keep
``num_key_value_groups = heads / kv_heads`` (unchanged by an even split), so the local
head count follows from the sharded weight; attributes that older transformers versions
keep (``num_heads``, ``num_key_value_heads``, ``hidden_size`` on the attention module) are
divided by tp so code reading them sees the local sizes.

With ``sequence_parallel`` the residual stream between blocks is sharded on the sequence
dim (``Shard(1)``): norms run on T/tp tokens, the entry of attention / MLP all-gathers
and o_proj / down_proj reduce-scatter instead of all-reducing (Korthikanti et al. 2022).
It needs ``T % tp == 0``.

FSDP2 composes after this step (2-D: ``fully_shard`` each block and the root on
``mesh["dp"]``); parameters become DTensors on the (dp, tp) sub-mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rlhf.models.arch import SUPPORTED_MODEL_TYPES as _SUPPORTED_MODEL_TYPES  # the families, one list
from rlhf.models.arch import VL_TEXT_FAMILY
from rlhf.models.gpt_oss import GPT_OSS_TYPES

# The class names below are what users see in errors.
_SEQUENCE_PARALLEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_GATHERED_QKV_TYPES = ("phi3", "olmoe")  # attention runs on all heads on every tp rank
SUPPORTED_CLASSES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    # critic / reward heads of the same families (score head kept replicated)
    "LlamaForTokenClassification",
    "Qwen2ForTokenClassification",
    "Qwen3ForTokenClassification",
    "MistralForTokenClassification",
)


def _model_class_name(model: nn.Module) -> str:
    """Name of the HF class (a pipeline stage reports the class it was cut from)."""
    return getattr(model, "source_class_name", type(model).__name__)


# Qwen-VL: tp splits the language model (its text family's plan); the vision tower stays replicated
# (every tp rank runs it whole on the same images: cheap next to the decoder, and no plan of its own).
VLM_CLASSES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
               "Qwen3VLForConditionalGeneration")


def _language_model(model: nn.Module) -> tuple[Any, Optional[nn.Module], str]:
    """(config, decoder module holding ``layers`` / ``embed_tokens``, family model type) of the LM to split."""
    config, inner = getattr(model, "config", None), getattr(model, "model", None)
    if _model_class_name(model) in VLM_CLASSES:
        family = VL_TEXT_FAMILY.get(getattr(config, "model_type", None))
        return config.text_config, getattr(inner, "language_model", None), family
    return config, inner, getattr(config, "model_type", None)


def tp_plan_supported(model: nn.Module) -> bool:
    """Whether :func:`apply_tp` has a plan for this model (or a pipeline stage of one)."""
    _, inner, model_type = _language_model(model)
    return (
        _model_class_name(model) in SUPPORTED_CLASSES + VLM_CLASSES
        and model_type in _SUPPORTED_MODEL_TYPES
        and inner is not None
        and hasattr(inner, "layers")
    )


def validate_tp(model: nn.Module, tp: int) -> None:
    """Raise ``ValueError`` naming the first size that tp does not divide.

    Checks the architecture, then ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size`` and ``vocab_size`` against ``tp``.
    """
    name = _model_class_name(model)
    if not tp_plan_supported(model):
        raise ValueError(
            f"tensor parallel has no plan for {name}; supported: {', '.join(SUPPORTED_CLASSES + VLM_CLASSES)}"
        )
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    config = _language_model(model)[0]
    heads = config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        **moe_sizes(config),
    }
    for key, value in sizes.items():
        if value % tp != 0:
            raise ValueError(
                f"{name}: {key}={value} is not divisible by parallel.tp={tp} "
                f"({key} % tp = {value % tp}); choose a tp that divides {value}"
            )


def moe_sizes(config) -> dict[str, int]:
    """Sizes a tp (training or rollout) must divide besides heads / intermediate / vocab: the experts
    (and Qwen2-MoE's shared expert, split like a dense MLP)."""
    from rlhf.models.moe_archs import MOE_MODEL_TYPES, num_experts

    experts = num_experts(config) if config.model_type in MOE_MODEL_TYPES else None
    shared = getattr(config, "shared_expert_intermediate_size", 0) if experts else 0
    if experts and config.model_type == "deepseek_v3":  # (partial configs too: the planner's, hub ones)
        shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
    return {**({"num_experts": experts} if experts else {}),
            **({"shared_expert_intermediate_size": shared} if shared else {})}


def _decoder_layers(model: nn.Module) -> Iterable[nn.Module]:
    layers = _language_model(model)[1].layers
    return layers.values() if isinstance(layers, nn.ModuleDict) else iter(layers)


def _layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if not sequence_parallel:
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    # Residual stream stays a Shard(1) DTensor so the `residual + out` adds in the HF
    # block see matching types; attention / MLP take local, sequence-gathered inputs.
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _family_plan(model_type: str, layer: nn.Module, experts: bool = True) -> dict[str, ParallelStyle]:
    """The (non-sequence-parallel) plan of one block of the families in the module docstring;
    ``experts=False`` leaves a MoE block's experts alone (expert parallelism shards them)."""
    if model_type == "phi3":
        return {"self_attn.qkv_proj": ColwiseParallel(output_layouts=Replicate()),
                "self_attn.o_proj": RowwiseParallel(input_layouts=Replicate()),
                "mlp.gate_up_proj": ColwiseParallel(output_layouts=Replicate()),
                "mlp.down_proj": RowwiseParallel(input_layouts=Replicate())}
    plan = _layer_plan(False)
    if model_type == "deepseek_v3":  # MLA: the per-head up-projections split, the latent ones replicated
        for p in "qkv":
            del plan[f"self_attn.{p}_proj"]
        q = "self_attn.q_b_proj" if getattr(layer.self_attn, "q_b_proj", None) is not None else "self_attn.q_proj"
        plan.update({q: ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel()})
    if model_type in _GATHERED_QKV_TYPES:  # OLMoE: q/k norms over the whole projection need all heads
        plan.update({f"self_attn.{p}_proj": ColwiseParallel(output_layouts=Replicate()) for p in "qkv"})
        plan["self_attn.o_proj"] = RowwiseParallel(input_layouts=Replicate())
    if hasattr(layer.mlp, "experts"):  # a sparse MoE block
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            del plan[name]
        if experts:
            plan["mlp.experts"] = ExpertsOverTP()
        for shared in ("shared_expert", "shared_experts"):  # Qwen2-MoE / DeepSeek-V3: a dense MLP beside the experts
            if getattr(layer.mlp, shared, None) is not None:
                plan.update({f"mlp.{shared}.gate_proj": ColwiseParallel(), f"mlp.{shared}.up_proj": ColwiseParallel(),
                             f"mlp.{shared}.down_proj": RowwiseParallel()})
    return plan


class ExpertsOverTP(ParallelStyle):
    """Experts over the tp mesh: ``gate_up_proj`` / ``down_proj`` (``[E, ...]``) become ``Shard(0)``
    DTensors and the module runs :func:`rlhf.models.moe.experts` on its local experts.

    The inputs (tokens, routing weights) are replicated over tp; this rank's experts contribute
    only part of their gradients, so they are declared ``Partial`` (summed over tp in the
    backward) and the output, a partial sum over experts, is all-reduced in the forward.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                for pname, p in list(mod.named_parameters(recurse=False)):
                    dt = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
                    mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        distribute_module(module, device_mesh, partition)
        module.forward = _experts_over_tp_forward.__get__(module)
        return module


def replicated_input(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``t`` (identical on every tp rank) whose gradient is summed over tp in the backward."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _experts_over_tp_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    from rlhf.models.gpt_oss import experts_args
    from rlhf.models.moe import experts

    mesh = self.gate_up_proj.device_mesh
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    out = experts(replicated_input(hidden_states, mesh), top_k_index, replicated_input(top_k_weights, mesh),
                  expert_offset=mesh.get_local_rank() * gate_up.shape[0], **experts_args(self, gate_up, down))
    return DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()


def _localize_attention_attrs(attn: nn.Module, tp: int) -> None:
    # transformers 5.x reads head counts from the weight shape (view(..., -1, head_dim));
    # older versions and some forks store them on the module, so keep those consistent.
    for attr in ("num_heads", "num_key_value_heads", "hidden_size"):
        value = getattr(attn, attr, None)
        if isinstance(value, int):
            setattr(attn, attr, value // tp)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
    experts: bool = True,
) -> None:
    """Shard ``model`` in place over the 1-D ``tp_mesh``.

    Args:
        model: an HF ``*ForCausalLM`` / ``*ForTokenClassification`` of a supported family
            (see ``SUPPORTED_CLASSES``) or a pipeline stage of one
            (:class:`rlhf.models.pipeline.PipelineStageModule`; missing ends are skipped).
        tp_mesh: ``mesh["tp"]``.
        sequence_parallel: shard norms / residual stream on the sequence dim (``T % tp``
            must be 0 at run time). Not supported together with pipeline stages.
        loss_parallel: keep LM-head logits sharded on the vocab (``[B, T, V]`` DTensor,
            ``Shard(-1)``); use :func:`rlhf.models.vocab_parallel.log_probs_from_logits`.
            When False, logits are all-gathered into a full local ``[B, T, V]``.
        experts: split MoE experts over tp (:class:`ExpertsOverTP`); False when expert
            parallelism places them (:mod:`rlhf.models.expert_parallel`, over ``(ep, tp)``).

    Raises:
        ValueError: unsupported architecture or a size tp does not divide.
    """
    tp = tp_mesh.size()
    if tp > 1 and not tp_plan_supported(model) and not sequence_parallel:  # other families: their HF plan
        from rlhf.models.generic_tp import apply_hf_tp
        from rlhf.models.loading import decoder_layers

        apply_hf_tp(model, tp_mesh, decoder_layers(model))
        return
    validate_tp(model, tp)
    _, inner, model_type = _language_model(model)
    if sequence_parallel and model_type not in _SEQUENCE_PARALLEL_TYPES:
        raise ValueError(f"sequence_parallel: no plan for {model_type}; "
                         f"supported: {', '.join(_SEQUENCE_PARALLEL_TYPES)}")
    if sequence_parallel and getattr(model, "source_class_name", None) is not None:
        raise ValueError(
            "sequence_parallel is not supported on pipeline stages (stage boundaries carry "
            "full-sequence activations); use sequence_parallel=False with pp > 1"
        )
    if tp == 1:
        return
    if model_type in GPT_OSS_TYPES:  # the sinks become tp-sharded DTensors, which only our attention reads
        from rlhf.models.varlen_attention import enable_varlen_attention

        enable_varlen_attention(model)
    tied = (
        getattr(model.config, "tie_word_embeddings", False)
        and getattr(inner, "embed_tokens", None) is not None
        and getattr(model, "lm_head", None) is not None
        and model.lm_head.weight is inner.embed_tokens.weight
    )

    if getattr(inner, "embed_tokens", None) is not None:
        parallelize_module(
            inner.embed_tokens,
            tp_mesh,
            RowwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(1) if sequence_parallel else Replicate(),
                use_local_output=not sequence_parallel,
            ),
        )
    for layer in _decoder_layers(model):
        plan = _layer_plan(True) if sequence_parallel else _family_plan(model_type, layer, experts)
        heads_dim = 1 if model_type == "gemma3_text" else 2  # q/k norms see [b, heads, T, hd] / [b, T, heads, hd]
        for norm in ("q_norm", "k_norm"):  # Qwen3 / Gemma 3: per-head RMSNorm of the local heads
            if getattr(layer.self_attn, norm, None) is not None and model_type not in _GATHERED_QKV_TYPES:
                # Each rank normalises its own heads: the weight is replicated and its
                # gradient is summed over tp (input seen as Shard on the heads dim).
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=heads_dim, use_local_output=True)
        parallelize_module(layer, tp_mesh, plan)
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:  # GPT-OSS: each rank's heads' sink logits (the attention reads the local part)
            layer.self_attn.register_parameter("sinks", nn.Parameter(
                distribute_tensor(sinks.data, tp_mesh, [Shard(0)], src_data_rank=None), requires_grad=sinks.requires_grad))
        if model_type == "olmoe" and getattr(model.config, "clip_qkv", None) is not None:
            # HF clamps v in place; the gathered projection output is a view of a DTensor autograd
            # function's output, which autograd forbids modifying in place
            layer.self_attn.v_proj.register_forward_hook(lambda mod, args, out: out.clone())
        if model_type == "deepseek_v3":
            from rlhf.models.mla import sum_rope_key_grad

            sum_rope_key_grad(layer.self_attn.kv_a_proj_with_mqa, model.config.qk_rope_head_dim, tp_mesh.get_group())
        if model_type not in _GATHERED_QKV_TYPES:  # Phi-3's / OLMoE's attention runs on all heads (docstring)
            _localize_attention_attrs(layer.self_attn, tp)
    if sequence_parallel and getattr(inner, "norm", None) is not None:
        parallelize_module(inner.norm, tp_mesh, SequenceParallel())

    head_in = Shard(1) if sequence_parallel else Replicate()
    if getattr(model, "lm_head", None) is not None:
        parallelize_module(
            model.lm_head,
            tp_mesh,
            ColwiseParallel(
                input_layouts=head_in,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        )
        if tied:
            # Vocab-parallel embedding and colwise head both shard the [V, H] weight on
            # dim 0 over the same mesh, so one DTensor parameter serves both.
            model.lm_head.weight = inner.embed_tokens.weight
    elif getattr(model, "score", None) is not None and sequence_parallel:
        # Tiny [H, n_labels] head stays replicated; it needs the full sequence back.
        parallelize_module(
            model.score,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        )
