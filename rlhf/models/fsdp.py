"""FSDP2 (`fully_shard`) per decoder block and root, with mixed precision on GPU.

Applied after TP (when enabled) and activation checkpointing, so the order is the
torchtitan one: apply_tp -> apply_ac -> apply_fsdp.
"""

from __future__ import annotations


import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rlhf.models.loading import decoder_layers


def apply_fsdp(model: torch.nn.Module, dp_mesh: DeviceMesh, *, device: torch.device,
               mixed_precision: bool = True, param_offload: bool = False,
               reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard each decoder block and the root over `dp_mesh`.

    FSDP2 averages gradients over dp. Every loss in this project is already normalised
    by global token/sequence counts, so callers multiply the loss by `grad_scale(dp_mesh)`
    before backward to turn that average into the sum they need. (Setting the divide
    factor to 1 would do the same but uses PREMUL_SUM, which gloo lacks.)
    """
    mp = None
    if mixed_precision and device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if param_offload and device.type != "cpu":  # on CPU the parameters already live in host memory
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif device.type != "cpu":
        model.to(device)
    for block in decoder_layers(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def grad_scale(dp_mesh: DeviceMesh) -> float:
    """Factor that undoes FSDP2's gradient averaging over dp (see apply_fsdp)."""
    return float(dp_mesh.size())
