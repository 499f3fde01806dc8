"""FP8 training of the actor (``actor.fp8``) through torchao's float8 linear layers.

``torchao.float8.convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear``
whose forward and backward matmuls run in e4m3 / e5m2 with dynamic tensor-wise scales
(``torch._scaled_mm``); the master weights, optimizer and gradients stay in their dtype. With
``all_gather`` FSDP2 gathers those weights in FP8 (``enable_fsdp_float8_all_gather``): half the bytes
of a bf16 all-gather. torchtitan applies it the same way: on the whole model, before FSDP2 wraps it.

Which layers: the decoder layers' linear weights whose two dims are multiples of 16 (``_scaled_mm``'s
requirement); the LM head (the log-probs' precision), MoE routers, a vision tower and LoRA adapters
stay in high precision. The parameters keep their names, so the reshard and checkpoints see the same
HF state dict.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rlhf.models.fp8 import supports_fp8
from rlhf.schema.config import ConfigError

PIP = "pip install 'torchao>=0.12' (or: pip install -e '.[fp8]')"
_LAYER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(.+\.)?\w*proj$")


def fp8_layer(fqn: str, module: nn.Module) -> bool:
    """Whether ``actor.fp8`` trains this module in FP8 (module docstring)."""
    return isinstance(module, nn.Linear) and _LAYER_LINEAR.search(fqn) is not None and ".visual." not in f".{fqn}" \
        and "lora_" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_fp8_training(device: torch.device) -> None:
    """Refuse ``actor.fp8`` in one line: a device without FP8 matmuls, or torchao missing."""
    if not supports_fp8(device):
        raise ConfigError(f"actor.fp8: FP8 training needs a GPU with FP8 matmuls (sm89+: Ada, Hopper, Blackwell); "
                          f"this rank's device is {device}: set actor.fp8=false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"actor.fp8: torchao is not installed: {PIP}") from None


def apply_fp8_training(model: nn.Module, device: torch.device, *, all_gather: bool = False) -> float:
    """Convert ``model``'s FP8 layers (:func:`fp8_layer`) to torchao ``Float8Linear`` in place, before FSDP2.

    Returns the share of the linear layers' weight elements that now train in FP8 (the ``perf/fp8``
    metric; 0 < share <= 1). Raises :class:`ConfigError` as :func:`check_fp8_training` does, or when no
    layer qualifies."""
    check_fp8_training(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = {n for n, m in linear.items() if fp8_layer(n, m)}
    if not chosen:
        raise ConfigError("actor.fp8: no decoder linear layer has dims that are multiples of 16; set actor.fp8=false")
    # a deferred load's weights carry their checkpoint sources (rlhf.models.shard_init); FP8 all-gather wraps
    # each weight in a new Parameter, which must carry them on
    marks = {n: {k: v for k, v in vars(linear[n].weight).items() if k.startswith("_rlhf_")} for n in chosen}
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    for n, attrs in marks.items():
        for k, v in attrs.items():
            setattr(model.get_submodule(n).weight, k, v)
    total = sum(m.weight.numel() for m in linear.values())
    return sum(linear[n].weight.numel() for n in chosen) / max(total, 1)
