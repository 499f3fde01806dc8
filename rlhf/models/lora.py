"""LoRA through peft: adapters-only training, cheap rollout sync, free reference model.

LoRA (Hu et al. 2021) freezes ``W`` and learns a low-rank update for each adapted
linear layer:

    W' = W + (alpha / r) * B @ A,   A: [r, in], B: [out, r]   (rsLoRA: alpha / sqrt(r))

Consequences the trainer uses:

* only ``A`` and ``B`` are trainable, so only they get gradients, optimizer state and
  FSDP2 reduce-scatters;
* the reference policy is the base model, i.e. the same module with the adapters
  switched off (:func:`reference_context`) - no second copy of the base weights;
* for rollout the base weights are resharded once and cached under their HF names;
  every step only the adapters move and :func:`merged_weights_for_rollout` forms ``W'``.

Names. peft wraps the model as ``base_model.model.<hf name>`` and each adapted linear
as ``<module>.base_layer`` + ``<module>.lora_A.<adapter>`` / ``lora_B.<adapter>``;
:func:`hf_param_name` maps any of these back to the plain HF parameter name.
verl settings of the same meaning: ``lora_rank``, ``lora_alpha``, ``target_modules``.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlhf.models.parallel import to_mesh_device

__all__ = [
    "apply_lora",
    "lora_adapter_state_dict",
    "hf_param_name",
    "base_weights_hf",
    "lora_scaling",
    "merged_weights_for_rollout",
    "reference_context",
    "save_adapter",
    "load_adapter",
    "export_merged",
]

_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


def apply_lora(
    model: nn.Module,
    *,
    lora_rank: int,
    lora_alpha: float,
    target_modules: str | Sequence[str] = "all-linear",
    lora_dropout: float = 0.0,
    use_rslora: bool = False,
) -> nn.Module:
    """Wrap an HF causal LM with LoRA adapters; only adapter parameters stay trainable.

    Args:
        model: an HF ``*ForCausalLM`` (not yet sharded).
        lora_rank: ``r`` (> 0).
        lora_alpha: ``alpha``; the update is scaled by ``alpha / r``.
        target_modules: ``"all-linear"`` (every linear layer except the LM head) or a
            list of module-name suffixes such as ``["q_proj", "v_proj"]``.
        lora_dropout: dropout on the adapter input.
        use_rslora: scale by ``alpha / sqrt(r)``.

    Returns:
        A ``peft.PeftModelForCausalLM``.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if lora_rank <= 0:
        raise ValueError(f"lora_rank must be > 0 to apply LoRA, got {lora_rank}")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    if not isinstance(targets, str):
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
        if unknown:
            valid = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ValueError(f"target_modules {unknown} match no linear layer; valid names: {valid}")
    config = LoraConfig(
        r=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=targets,
        lora_dropout=lora_dropout,
        bias="none",
        use_rslora=use_rslora,
        task_type=TaskType.CAUSAL_LM,
        # A vision-language model: adapters on the language model only (the vision tower stays frozen, as
        # in verl's VLM LoRA recipes); a list of names chooses its layers explicitly.
        exclude_modules=r".*\.visual\..*" if isinstance(targets, str) and _has_vision_tower(model) else None,
    )
    return get_peft_model(model, config)


def _has_vision_tower(model: nn.Module) -> bool:
    return any(n.endswith("visual") for n, _ in model.named_modules())


def hf_param_name(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def _full(t: torch.Tensor) -> torch.Tensor:
    """Materialise a DTensor (FSDP2 shard) as a full tensor; plain tensors pass through."""
    return to_mesh_device(t).full_tensor() if isinstance(t, DTensor) else t


def lora_adapter_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Adapter weights only, under PEFT's saved names
    (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``).
    Tensors are the model's own (DTensor shards stay shards)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=adapter_name)


def base_weights_hf(model: nn.Module, full: bool = True) -> dict[str, torch.Tensor]:
    """The frozen base weights of a peft model under HF names (adapters excluded) -
    what the rollout side caches once. ``full`` gathers FSDP2 shards."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[hf_param_name(name)] = _full(t) if full else t
    return out


def lora_scaling(lora_alpha: float, lora_rank: int, use_rslora: bool = False) -> float:
    """``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA), peft's ``scaling``."""
    return lora_alpha / (lora_rank**0.5 if use_rslora else lora_rank)


def merged_weights_for_rollout(
    base_weights: dict[str, torch.Tensor],
    adapter_weights: dict[str, torch.Tensor],
    lora_alpha: float,
    lora_rank: int,
    *,
    use_rslora: bool = False,
    slice_delta=None,
) -> dict[str, torch.Tensor]:
    """HF-named weights with ``W + scaling * B @ A`` for every adapted linear.

    ``slice_delta(delta, name)``: with a tensor-parallel rollout the base weights are this rank's
    slices; the full ``B @ A`` (adapters are small and gathered whole) is cut the same way.

    Args:
        base_weights: cached full base weights, HF names (``model.layers.0.self_attn.q_proj.weight``).
        adapter_weights: adapters under PEFT names (with or without the ``.default`` adapter
            segment and the ``base_model.model.`` prefix).
        lora_alpha, lora_rank: as in :func:`apply_lora`.

    Returns:
        A new dict with every key of ``base_weights``; adapted weights are new tensors
        (merge in fp32, cast back to the base dtype), the others are the cached ones.
    """
    scale = lora_scaling(lora_alpha, lora_rank, use_rslora)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter_weights.items():
        m = _LORA_KEY.match(hf_param_name(key))
        if m is None:
            continue
        pairs.setdefault(m.group("module"), {})[m.group("ab")] = _full(t)
    if not pairs:
        raise ValueError("adapter_weights holds no lora_A / lora_B weights")
    merged = dict(base_weights)
    for module, ab in pairs.items():
        wkey = f"{module}.weight"
        if wkey not in base_weights:
            raise KeyError(f"adapter for '{module}' has no base weight '{wkey}' in base_weights")
        if set(ab) != {"A", "B"}:
            raise KeyError(f"adapter for '{module}' is missing lora_{'B' if 'A' in ab else 'A'}")
        w = base_weights[wkey]
        delta = ab["B"].to(device=w.device, dtype=torch.float32) @ ab["A"].to(device=w.device, dtype=torch.float32)
        if slice_delta is not None:
            delta = slice_delta(delta, wkey)
        merged[wkey] = (w.float() + scale * delta).to(w.dtype)
    return merged


def reference_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context in which ``model`` is the base model (adapters off): the reference policy
    without a second copy of the base weights."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise TypeError(
            f"reference_context needs a peft model (apply_lora); got {type(model).__name__}. "
            "Without LoRA the reference is a separate frozen model."
        )
    return disable()


def save_adapter(model: nn.Module, directory: str | Path) -> None:
    """Save the adapters in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``).
    Call on full (gathered) tensors, i.e. on one rank after gathering FSDP2 shards."""
    model.save_pretrained(str(directory), safe_serialization=True)


def load_adapter(base_model: nn.Module, directory: str | Path, is_trainable: bool = False) -> nn.Module:
    """Load a PEFT adapter directory onto an HF base model."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, str(directory), is_trainable=is_trainable)


def export_merged(model: nn.Module, directory: str | Path) -> None:
    """Write a plain HF checkpoint (safetensors) with the adapters merged in.

    The training model is left untouched (no ``merge_and_unload``): the merged weights
    are formed out of place from the base weights and the adapters.
    """
    config = model.peft_config[model.active_adapter]
    merged = merged_weights_for_rollout(
        base_weights_hf(model),
        {k: _full(v) for k, v in lora_adapter_state_dict(model).items()},
        config.lora_alpha,
        config.r,
        use_rslora=config.use_rslora,
    )
    base = model.get_base_model()
    base.save_pretrained(str(directory), state_dict=merged, safe_serialization=True)

