"""AdamW and the warmup + constant/cosine learning-rate schedules (verl's numbers)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(params, *, lr: float, weight_decay: float, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (did LoRA freeze everything?)")
    # foreach=False: DTensor params from several meshes (FSDP x TP) are not always groupable.
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=False)


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    """verl: lr_warmup_steps if >= 0 else int(lr_warmup_steps_ratio * total_steps)."""
    return warmup_steps if warmup_steps >= 0 else int(warmup_ratio * total_steps)


def lr_lambda(step: int, *, total_steps: int, warmup: int, style: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based).

    Linear warmup from 0 over `warmup` steps, then constant or a half-cosine down to
    `min_lr_ratio` at `total_steps` (transformers' get_cosine_schedule_with_warmup shape).
    """
    if warmup > 0 and step < warmup:
        return float(step) / float(max(1, warmup))
    if style == "constant":
        return 1.0
    progress = float(step - warmup) / float(max(1, total_steps - warmup))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cos


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int,
                    warmup_ratio: float, style: str, min_lr_ratio: float = 0.0) -> LambdaLR:
    warmup = warmup_steps_for(total_steps, warmup_steps, warmup_ratio)
    return LambdaLR(optimizer, lambda s: lr_lambda(s, total_steps=total_steps, warmup=warmup,
                                                   style=style, min_lr_ratio=min_lr_ratio))


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global gradient norm over (DTensor) parameters, clipped in place; returns the norm."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm
