"""Activation checkpointing per decoder block, and FSDP2 CPU-offload options.

Activation checkpointing (verl's ``enable_gradient_checkpointing``) keeps only each
decoder block's inputs during the forward and recomputes the block during the backward:
activation memory drops from ``O(layers * tokens * (H + I))`` to
``O(layers * tokens * H + tokens * (H + I))`` for about one extra forward of compute.

How it is wrapped. :func:`apply_ac` replaces the *instance* ``forward`` of every decoder
block by one that runs the class ``forward`` under ``torch.utils.checkpoint.checkpoint``
(non-reentrant, RNG state preserved so dropout replays identically). Consequences:

* parameter and state-dict names do not change (no ``_checkpoint_wrapped_module.``
  segment as with ``checkpoint_wrapper``), so FSDP2, DCP checkpoints, HF export and the
  rollout reshard see the usual names;
* module hooks stay outside the checkpointed region: FSDP2's pre-forward all-gather runs
  once in the forward, and its pre-backward hook has the parameters gathered again before
  the recompute (the order torchtitan uses: ``apply_ac`` then ``fully_shard``);
* it works on peft-wrapped models and survives ``copy.deepcopy`` (bound method).

For code that meets names from other wrappers, :func:`normalize_param_name` strips
``_checkpoint_wrapped_module.``, ``_orig_mod.`` (torch.compile) and
``_fsdp_wrapped_module.`` (FSDP1).

Offload. ``fully_shard(module, **fsdp_offload_kwargs(True))`` keeps the sharded
parameters on CPU and copies them to the device for each all-gather; gradients are
reduce-scattered and moved to CPU, and ``optimizer.step`` runs on CPU - so the optimizer
state (Adam's ``exp_avg`` / ``exp_avg_sq``) is created and stays on CPU too: verl's
``param_offload`` + ``optimizer_offload`` together. For optimizer-state offload alone
(parameters stay on the device), move the state between steps with
:func:`offload_optimizer_state` / :func:`load_optimizer_state`.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "decoder_blocks",
    "apply_ac",
    "remove_ac",
    "is_ac_applied",
    "normalize_param_name",
    "fsdp_offload_kwargs",
    "offload_optimizer_state",
    "load_optimizer_state",
]

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _block_class_names(model: nn.Module) -> set[str]:
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return set(getattr(m, "_no_split_modules", None) or [])
    return set()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of an HF model (outermost modules whose class, or a base class,
    is in ``_no_split_modules``; transformers' ``GradientCheckpointingLayer`` otherwise)."""
    names = _block_class_names(model)

    def is_block(m: nn.Module) -> bool:
        if names:
            return any(c.__name__ in names for c in type(m).__mro__)
        from transformers.modeling_layers import GradientCheckpointingLayer

        return isinstance(m, GradientCheckpointingLayer)

    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if is_block(m):
            blocks.append(m)
            inside.update(id(s) for s in m.modules())
    return blocks


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def is_ac_applied(module: nn.Module) -> bool:
    """True when ``module``'s forward is the checkpointed one installed by :func:`apply_ac`."""
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, types.MethodType) and fwd.__func__ is _checkpointed_forward


def apply_ac(model: nn.Module, blocks: list[nn.Module] | None = None) -> int:
    """Checkpoint every decoder block (idempotent). Apply before ``fully_shard``.

    Args:
        model: an HF model, possibly peft-wrapped.
        blocks: modules to wrap (default: :func:`decoder_blocks`).

    Returns:
        The number of blocks wrapped.
    """
    blocks = decoder_blocks(model) if blocks is None else blocks
    if not blocks:
        raise ValueError(f"apply_ac found no decoder blocks in {type(model).__name__}; pass blocks= explicitly")
    for block in blocks:
        # transformers' own per-layer checkpointing would nest a second checkpoint
        if getattr(block, "gradient_checkpointing", False):
            block.gradient_checkpointing = False
        if not is_ac_applied(block):
            block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)


def remove_ac(model: nn.Module) -> int:
    """Undo :func:`apply_ac`; returns how many blocks were unwrapped."""
    n = 0
    for m in model.modules():
        if is_ac_applied(m):
            del m.forward
            n += 1
    return n


def normalize_param_name(name: str) -> str:
    """Drop wrapper segments (``_checkpoint_wrapped_module.``, ``_orig_mod.``,
    ``_fsdp_wrapped_module.``) from a parameter / state-dict name."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def fsdp_offload_kwargs(param_offload: bool) -> dict[str, Any]:
    """Keyword arguments for ``fully_shard``: ``{"offload_policy": CPUOffloadPolicy()}``
    when ``param_offload`` (params, grads and the optimizer step on CPU), else ``{}``.
    Pinned host memory is used only when an accelerator exists."""
    if not param_offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())}


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device) and key != "step":
                state[key] = value.to(device, non_blocking=True)
                moved += value.numel() * value.element_size()
    return moved


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Move optimizer state tensors to CPU between steps (verl's ``optimizer_offload``
    without ``param_offload``); returns bytes moved. ``step`` counters stay where they are
    (Adam keeps them on CPU unless ``capturable``)."""
    return _move_optimizer_state(optimizer, "cpu")


def load_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Bring optimizer state back to ``device`` before ``optimizer.step``; returns bytes moved."""
    return _move_optimizer_state(optimizer, device)
