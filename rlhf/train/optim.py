"""AdamW and the warmup + constant/cosine learning-rate schedules (verl's numbers)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from rlhf.schema.errors import NonFiniteError


def foreach_groups(params) -> list[list[torch.Tensor]]:
    """Parameters split so that each list can run as one foreach (multi-tensor) update: DTensors of
    one device mesh together (FSDP-only ``[dp]`` and FSDP x TP ``[dp, tp]`` parameters cannot share
    a foreach op), plain tensors by device; first-seen order kept inside and across groups."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        key = ("mesh", mesh) if mesh is not None else ("device", p.device)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def build_optimizer(params, *, lr: float, weight_decay: float, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW with one foreach param group per device mesh (one DTensor dispatch per op and group,
    not per parameter; on the host under ``model.param_offload``, multi-tensor kernels)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (did LoRA freeze everything?)")
    groups = [{"params": g} for g in foreach_groups(params)]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=True)


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


def clip_grad_norm(params, max_norm: float, *, device: torch.device | None = None, group=None) -> torch.Tensor:
    """Global gradient norm over (DTensor) parameters, clipped in place; returns the norm.

    The trainer's helper (:func:`rlhf.models.parallelize.clip_grad_norm_`) for a layout with no
    pipeline stages (SFT): every rank of ``group`` (default: world) holds part of one stage. The
    norm is reduced on ``device`` (the compute device), so gradients kept on the host by
    ``model.param_offload`` are never all-reduced as CPU tensors over NCCL.
    """
    import torch.distributed as dist

    from rlhf.models.parallelize import clip_grad_norm_

    stage_ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    return clip_grad_norm_(list(params), max_norm, stage_ranks=stage_ranks, group=group, device=device)


class NonFiniteGuard:
    """Skip (and count) optimizer steps whose loss or grad norm is not finite.

    A single bad batch should not poison the weights, but a run that keeps producing them
    is broken: after `max_consecutive` skipped steps in a row it raises NonFiniteError
    with `hint` (which setting to look at).
    """

    def __init__(self, name: str, hint: str, max_consecutive: int = 3):
        self.name, self.hint, self.max_consecutive = name, hint, max_consecutive
        self.in_a_row = 0
        self.skipped = 0  # total over the run (checkpointed by the trainer)

    def ok(self, loss: float, grad_norm: float, optimizer: torch.optim.Optimizer) -> bool:
        """True when the step may be taken; otherwise drop the gradients, count, maybe abort."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        optimizer.zero_grad(set_to_none=True)
        self.in_a_row += 1
        self.skipped += 1
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[rlhf] {self.name}: non-finite loss/grad norm (loss={loss}, grad_norm={grad_norm}); "
                  f"optimizer step skipped ({self.in_a_row} in a row)", flush=True)
        if self.in_a_row > self.max_consecutive:
            raise NonFiniteError(f"{self.name}: {self.in_a_row} consecutive non-finite optimizer steps "
                                 f"(last loss={loss}, grad_norm={grad_norm}); {self.hint}")
        return False
