"""Tensor parallelism (Megatron-style) for HF decoder-only LMs via DTensor plans.

Plan per decoder block (``parallelize_module`` on the 1-D tp mesh)::

    self_attn.{q,k,v}_proj   ColwiseParallel   -> each rank owns heads/tp (kv_heads/tp)
    self_attn.o_proj         RowwiseParallel   -> partial sums all-reduced
    self_attn.{q,k}_norm     replicated weight, grads summed over tp (Qwen3 per-head norms)
    mlp.{gate,up}_proj       ColwiseParallel   -> intermediate/tp columns
    mlp.down_proj            RowwiseParallel

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

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

# HF model_type -> family name; the class names below are what users see in errors.
_SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_CLASSES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    # critic / reward heads of the same families (score head kept replicated)
    "LlamaForTokenClassification",
    "Qwen2ForTokenClassification",
    "Qwen3ForTokenClassification",
    "MistralForTokenClassification",
)


def _model_class_name(model: nn.Module) -> str:
    """Name of the HF class (a pipeline stage reports the class it was cut from)."""
    return getattr(model, "source_class_name", type(model).__name__)


def tp_plan_supported(model: nn.Module) -> bool:
    """Whether :func:`apply_tp` has a plan for this model (or a pipeline stage of one)."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    return (
        _model_class_name(model) in SUPPORTED_CLASSES
        and getattr(config, "model_type", None) in _SUPPORTED_MODEL_TYPES
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
            f"tensor parallel has no plan for {name}; supported: {', '.join(SUPPORTED_CLASSES)}"
        )
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    config = model.config
    heads = config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for key, value in sizes.items():
        if value % tp != 0:
            raise ValueError(
                f"{name}: {key}={value} is not divisible by parallel.tp={tp} "
                f"({key} % tp = {value % tp}); choose a tp that divides {value}"
            )


def _decoder_layers(model: nn.Module) -> Iterable[nn.Module]:
    layers = model.model.layers
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

    Raises:
        ValueError: unsupported architecture or a size tp does not divide.
    """
    tp = tp_mesh.size()
    validate_tp(model, tp)
    if sequence_parallel and getattr(model, "source_class_name", None) is not None:
        raise ValueError(
            "sequence_parallel is not supported on pipeline stages (stage boundaries carry "
            "full-sequence activations); use sequence_parallel=False with pp > 1"
        )
    if tp == 1:
        return
    inner = model.model
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
        plan = _layer_plan(sequence_parallel)
        for norm in ("q_norm", "k_norm"):  # Qwen3: per-head RMSNorm on [b, T, heads, head_dim]
            if getattr(layer.self_attn, norm, None) is not None:
                # Each rank normalises its own heads: the weight is replicated and its
                # gradient is summed over tp (input seen as Shard on the heads dim).
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, tp_mesh, plan)
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
