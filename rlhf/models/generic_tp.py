"""Tensor parallel for families outside the fast list, from the model's own ``base_model_tp_plan``.

transformers ships, per family, a plan naming how each projection of a decoder block splits
(``{"layers.*.self_attn.q_proj": "colwise", ...}``). The hand-written plans of
``rlhf.models.tensor_parallel`` cover the fast families; any other model with a plan made only of the
styles below is split by it, one ``parallelize_module`` per block:

===========================  ===================================================================
HF style                     torch parallel style
===========================  ===================================================================
``colwise``                  ``ColwiseParallel()``: output features sharded (this rank's heads)
``rowwise``                  ``RowwiseParallel()``: input features sharded, output all-reduced
``colwise_gather_output``    ``ColwiseParallel(output_layouts=Replicate())``: the full projection
                             (OLMo's q / k norms over all heads), gathered
``rowwise_split_input``      ``RowwiseParallel(input_layouts=Replicate())``: the full input split here
===========================  ===================================================================

Embeddings, norms and the LM head stay whole on every tp rank (FSDP2 shards them over dp; the logits
are full, not vocab-sharded). Other styles (``replicated_with_grad_allreduce`` norms of local heads,
expert-parallel ones, ``gather``) would need per-family care: such a plan is refused in one line.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
_LAYER_PREFIX = "layers.*."


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def layer_plan(model: nn.Module) -> tuple[dict[str, str] | None, str]:
    """The per-block HF plan ``{submodule: style}`` of ``model`` and, when it cannot be applied, why."""
    config = _config(model)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    name = getattr(config, "model_type", type(model).__name__)
    if not plan:
        return None, f"{name} has no base_model_tp_plan in transformers"
    out = {}
    for key, style in plan.items():
        if not key.startswith(_LAYER_PREFIX):
            return None, f"{name}'s tp plan entry {key!r} is outside the decoder blocks"
        if style not in _STYLES:
            return None, (f"{name}'s tp plan style {style!r} ({key}) is not supported; "
                          f"supported: {', '.join(_STYLES)}")
        out[key[len(_LAYER_PREFIX):]] = style
    return out, ""


def apply_hf_tp(model: nn.Module, tp_mesh: DeviceMesh, blocks: list[nn.Module]) -> None:
    """Split ``blocks`` (the decoder blocks of ``model``) over ``tp_mesh`` by the model's HF plan;
    raises ValueError (one line) when it has none that applies."""
    plan, why = layer_plan(model)
    if plan is None:
        raise ValueError(f"tensor parallel: {type(model).__name__}: {why} (and it is not one of the fast families' "
                         f"hand-written plans); set parallel.tp=1 for this model")
    tp = tp_mesh.size()
    for block in blocks:
        present = {k: v for k, v in plan.items() if _has(block, k)}  # a family's dense / MoE blocks differ
        parallelize_module(block, tp_mesh, {k: _STYLES[v]() for k, v in present.items()})
        for attn in block.modules():
            # heads split over tp (colwise q): transformers 5 reads head counts from the weight shape,
            # a module attribute holding them is kept consistent
            if any(k.endswith("q_proj") and v == "colwise" for k, v in present.items()):
                for attr in ("num_heads", "num_key_value_heads"):
                    if isinstance(getattr(attn, attr, None), int) and hasattr(attn, "q_proj"):
                        setattr(attn, attr, getattr(attn, attr) // tp)


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True
