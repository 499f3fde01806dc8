"""FSDP2 (`fully_shard`) per decoder block and root, with mixed precision on GPU.

Applied after TP (when enabled) and activation checkpointing, so the order is the
torchtitan one: apply_tp -> apply_ac -> apply_fsdp. The model is sharded on the meta
device and only this rank's shards are then placed (:mod:`rlhf.models.shard_init`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from rlhf.models.loading import decoder_layers, vision_tower
from rlhf.models.shard_init import materialize_shards, params_to_meta

# Device types on which ``mixed_precision=True`` takes effect (bf16 compute, fp32 reduce).
# CUDA only in runs; a test adds "cpu" to drive the mixed-precision path over gloo.
MIXED_PRECISION_DEVICES = {"cuda"}

# ``model.fsdp_unit: auto`` makes the whole model one FSDP2 unit up to this many bytes of
# (unsharded, master-dtype) parameters. Below it a per-block all-gather / reduce-scatter moves
# kilobytes and costs its latency and Python dispatch, not bandwidth (the 0.8M-parameter
# quickstart: 5 all-gathers per forward, 5 more in backward, 5 reduce-scatters), while holding
# the whole model unsharded costs at most this much memory per rank.
FSDP_MODEL_UNIT_MAX_BYTES = 64 * 2**20
FSDP_UNITS = ("auto", "block", "model")


def resolve_fsdp_unit(unit: str, param_bytes: float) -> str:
    """``model.fsdp_unit`` as applied to a model (or pipeline stage) of ``param_bytes`` bytes.

    "block": one FSDP2 unit per decoder block plus the root (embeddings, norm, head): at most
    the root and two blocks are unsharded at once. "model": one unit, the root: one all-gather
    per forward and one reduce-scatter per backward; in the update the parameters stay gathered
    from forward to backward (:func:`keep_unsharded`). "auto": "model" up to
    ``FSDP_MODEL_UNIT_MAX_BYTES``, else "block". The maths is the same either way (all-gather
    is a copy, the reduce-scatter sums the same gradients), so the choice only moves time and memory.
    """
    if unit not in FSDP_UNITS:
        raise ValueError(f"model.fsdp_unit: unknown value {unit!r}; valid: {', '.join(FSDP_UNITS)}")
    if unit == "auto":
        return "model" if param_bytes <= FSDP_MODEL_UNIT_MAX_BYTES else "block"
    return unit


@contextmanager
def keep_unsharded(module: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, a whole-model FSDP2 unit is not resharded after forward: the backward
    reuses the forward's all-gather instead of gathering again (every forward here is followed
    by its backward, which reshards). On exit the module reshards after forward again, so a
    no-grad pass (log-probs, values) never leaves full parameters behind, and it is resharded
    even if the block raised between a forward and its backward."""
    if not enabled or not isinstance(module, FSDPModule):
        yield
        return
    module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        module.set_reshard_after_forward(True, recurse=False)
        module.reshard()


def mixed_precision_policy(enabled: bool, device: torch.device) -> Optional[MixedPrecisionPolicy]:
    """bf16 parameters in forward / backward, fp32 gradient reduce; None where it does not apply."""
    if not enabled or device.type not in MIXED_PRECISION_DEVICES:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def offload_threads(cpu_count: int, local_world_size: int, current: int) -> int:
    """Intra-op threads for a rank whose optimizer step runs on the host (``model.param_offload``):
    its share of the machine's cores. torchrun sets ``OMP_NUM_THREADS=1``, which left a 30B AdamW
    step single-threaded (tens of seconds per mini-batch); never lowers a larger setting."""
    return max(current, cpu_count // max(1, local_world_size), 1)


def set_offload_threads() -> int:
    """Apply :func:`offload_threads` to this process (cores it may run on / ranks on this node)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = offload_threads(cpus, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.get_num_threads())
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def apply_fsdp(model: torch.nn.Module, dp_mesh: DeviceMesh, *, device: torch.device,
               mixed_precision: bool = True, param_offload: bool = False,
               reshard_after_forward: bool = True, host: Optional[dict[str, torch.Tensor]] = None,
               expert_mesh: Optional[DeviceMesh] = None, load_ranks_per_node: int = 0,
               unit: str = "block") -> torch.nn.Module:
    """Shard each decoder block and the root over `dp_mesh` (``unit="model"``: the root only,
    one unit holding every parameter; see :func:`resolve_fsdp_unit`), then place this rank's shards.

    ``host``: the host tensors of a model whose parameters :func:`params_to_meta` already
    moved to the meta device (``parallelize_model`` does so before TP); None = done here.
    ``load_ranks_per_node``: local ranks that read and place their shards at once (0 = auto;
    :func:`rlhf.models.shard_init.load_turns`).
    The device never holds more than this rank's shards (CPU offload: the shards stay in
    host memory).

    FSDP2 averages gradients over dp. Every loss in this project is already normalised
    by global token/sequence counts, so callers multiply the loss by `grad_scale(dp_mesh)`
    before backward to turn that average into the sum they need. (Setting the divide
    factor to 1 would do the same but uses PREMUL_SUM, which gloo lacks.)

    ``expert_mesh``: under expert parallelism, the "efsdp" mesh each block's ``mlp.experts``
    (already ``Shard(0)`` over ep) is sharded over, as its own FSDP2 unit inside the block.
    """
    if host is None:
        host = params_to_meta(model)
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    mp = mixed_precision_policy(mixed_precision, device)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if param_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs a GPU
        if device.type == "cuda":  # the optimizer step runs on the host (foreach AdamW: rlhf.train.optim)
            set_offload_threads()
    if unit not in ("block", "model"):
        raise ValueError(f"apply_fsdp: unit must be 'block' or 'model' (resolve 'auto' first), got {unit!r}")
    for block in decoder_layers(model):
        # Units that differ from their block whatever `unit` is: experts sharded over the ep mesh, and
        # the fp32 router.
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if expert_mesh is not None and experts is not None:
            fully_shard(experts, **{**kwargs, "mesh": expert_mesh})
        router = getattr(block.mlp, "gate", None) or getattr(block.mlp, "router", None)  # GPT-OSS: router
        if mp is not None and experts is not None and router is not None:
            # MoE router in fp32 under bf16 (its own unit; inputs cast up): which experts a token takes
            # is a discrete choice that bf16 logits flip (the rollout / trainer routing mismatch).
            fully_shard(router, **{**kwargs, "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32)})
        if unit == "block":
            fully_shard(block, **kwargs)
    visual = vision_tower(model)
    if visual is not None and unit == "block":
        # One unit: its all-gather / reduce-scatter run on every rank every micro-batch (a text-only
        # micro-batch feeds it a dummy image, rlhf.models.vlm.dummy_vision_loss), so ranks never diverge.
        fully_shard(visual, **kwargs)
    fully_shard(model, **kwargs)
    materialize_shards(model, host, torch.device("cpu") if param_offload else device, load_ranks_per_node)
    return model


def grad_scale(dp_mesh: DeviceMesh) -> float:
    """Factor that undoes FSDP2's gradient averaging over dp (see apply_fsdp)."""
    return float(dp_mesh.size())
