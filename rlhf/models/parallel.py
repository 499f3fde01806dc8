"""The distributed layout: ParallelDims, process-group init and the one named DeviceMesh.

The same program runs as plain ``python train_grpo.py`` (one process, world size 1, no
process group needed but one is created so every code path is the same) and under
``torchrun`` on any number of nodes. nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlhf.schema.config import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the (pp, dp, sp, tp) mesh, validated against the world size.

    The mesh is laid out pp-major, tp-minor so TP groups are adjacent ranks (same node),
    then the Ulysses sequence-parallel groups (``sp``; ranks that share the same rows and
    split their tokens). Data (prompts, rollouts) is divided over ``dp`` only; FSDP2 shards
    and reduces gradients over the flattened ``dp x sp`` sub-mesh ("dp_sp").

    Expert parallelism (``ep`` > 1, MoE models): the dp ranks split as ``efsdp x ep``, the mesh is
    ``(pp, efsdp, ep, sp, tp)`` with ``(efsdp, ep)`` flattened into "dp"; experts are sharded over
    "ep" and FSDP2-sharded over "efsdp" (``rlhf.models.expert_parallel``).
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    sp: int = 1
    ep: int = 1

    @classmethod
    def resolve(cls, dp: int, tp: int, pp: int, world_size: int, sp: int = 1, ep: int = 1) -> "ParallelDims":
        if tp < 1 or pp < 1 or sp < 1:
            raise ConfigError(f"parallel.tp ({tp}), parallel.pp ({pp}) and parallel.sp ({sp}) must be >= 1")
        model_ranks = tp * pp * sp
        sizes = f"parallel.tp x pp x sp = {tp} x {pp} x {sp}" if sp > 1 else f"parallel.tp x parallel.pp = {tp} x {pp}"
        if dp == -1:
            if world_size % model_ranks != 0:
                raise ConfigError(
                    f"impossible parallel layout: world size {world_size} is not divisible by {sizes} = {model_ranks}")
            dp = world_size // model_ranks
        if dp * model_ranks != world_size:
            raise ConfigError(
                f"impossible parallel layout: parallel.dp x tp x pp{' x sp' if sp > 1 else ''} = {dp} x {tp} x {pp}"
                f"{f' x {sp}' if sp > 1 else ''} = {dp * model_ranks} "
                f"but the world size is {world_size} (set parallel.dp: -1 to infer it)")
        check_ep(ep, dp, sp)
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size, sp=sp, ep=ep)

    def build_mesh(self, device_type: str, roles: int = 1) -> DeviceMesh:
        """The (pp, dp, sp, tp) mesh. ``roles=2`` (trainer.mode one_step_off): the world mesh
        ``(role, pp, dp, sp, tp)`` of two equal halves; the caller slices its role's sub-mesh.
        A collective: every rank builds every group here, before the roles part ways."""
        dims: tuple[int, ...] = (self.pp, self.dp, self.sp, self.tp)
        names: tuple[str, ...] = ("pp", "dp", "sp", "tp")
        if self.ep > 1:
            dims = (self.pp, self.dp // self.ep, self.ep, self.sp, self.tp)
            names = ("pp", "efsdp", "ep", "sp", "tp")
        if roles > 1:
            dims, names = (roles, *dims), ("role", *names)
        mesh = init_device_mesh(device_type, dims, mesh_dim_names=names)
        if self.ep > 1:
            mesh["efsdp", "ep"]._flatten(mesh_dim_name="dp")
        if self.sp > 1:
            mesh["dp", "sp"]._flatten(mesh_dim_name="dp_sp")
        return mesh

    def check_batch(self, *, train_batch_size: int, n: int, mini_batch_size: int) -> None:
        """Global prompt counts must split evenly over dp ranks."""
        for key, value in (("data.train_batch_size", train_batch_size), ("actor.ppo_mini_batch_size", mini_batch_size)):
            if value % self.dp != 0:
                raise ConfigError(f"impossible parallel layout: {key} ({value}) is not divisible by dp ({self.dp})")


def check_ep(ep: int, dp: int, sp: int = 1) -> None:
    """``parallel.ep`` must divide the data-parallel size (the ep group is taken from the dp ranks)."""
    if ep < 1 or dp % ep:
        raise ConfigError(f"impossible parallel layout: parallel.ep={ep} must be >= 1 and divide dp={dp} "
                          "(the expert-parallel group is taken from the data-parallel ranks)")
    if ep > 1 and sp > 1:
        raise ConfigError("parallel.ep > 1 with parallel.sp > 1 is not supported; set one of them to 1")


def expert_fsdp_mesh(mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The sub-mesh FSDP2 shards the experts over ("efsdp" = dp / ep), or None without expert parallelism."""
    names = mesh.mesh_dim_names or ()
    return mesh["efsdp"] if "ep" in names and mesh["ep"].size() > 1 else None


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # The ranks this program part runs on: None = the world; a role's group under trainer.mode
    # one_step_off (ranks [0, world_size) train, so ``rank`` stays the global rank).
    group: Optional[dist.ProcessGroup] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device is 'cuda' but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistEnv:
    """Initialise the default process group from torchrun's env vars (or a 1-process group).

    ``timeout_s``: how long a collective of any group waits for the slowest rank before it fails.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            # Plain `python train_grpo.py`: a private 1-process group on a free port.
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        timeout = datetime.timedelta(seconds=timeout_s)
        # DeviceMesh and new_group subgroups take the backend's module-level default (30 min gloo,
        # 10 min NCCL), not the default group's timeout; set it so every group uses this one.
        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                                store=_attempt_store(world_size, timeout))
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend)


def _attempt_store(world_size: int, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Under torchrun, its agent's store with a key prefix per restart attempt (None otherwise:
    the env:// default, where rank 0 hosts a fresh store).

    Why: workers restarted by ``torchrun --max-restarts`` reuse the agent's store, where the
    failed attempt's process-group keys (each rank's listening address) are still there, so the
    new ranks dial dead ports ("connectFullMesh ... Connection refused"; pytorch/pytorch#167288).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"rlhf/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP2 shards over: "dp_sp" when Ulysses sp > 1, else "dp"."""
    names = mesh.mesh_dim_names or ()
    if "sp" in names and mesh["sp"].size() > 1:
        return mesh["dp_sp"]
    return mesh["dp"]


_MESH_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def mesh_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    """All ranks of ``mesh`` as one group: None when that is the world, else a group created (once)
    by its members only (a role's sub-mesh under trainer.mode one_step_off)."""
    ranks = tuple(mesh.mesh.flatten().tolist())
    if len(ranks) == dist.get_world_size():
        return None
    if ranks not in _MESH_GROUPS:
        _MESH_GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _MESH_GROUPS[ranks]


def sp_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    """The Ulysses sequence-parallel group, or None when sp == 1 (or the mesh has no sp)."""
    names = mesh.mesh_dim_names or ()
    if "sp" in names and mesh["sp"].size() > 1:
        return mesh["sp"].get_group()
    return None


def collective_device(tensor_device: torch.device, mesh_device_type: str) -> Optional[torch.device]:
    """Where a tensor must be before a collective on a mesh of ``mesh_device_type``: None when
    it already is, else that device type ("cuda" = the current device, as the mesh's own
    collectives use). NCCL reads device memory only, while FSDP2 CPU offload
    (``model.param_offload``) keeps the shards in host memory."""
    if tensor_device.type == mesh_device_type:
        return None
    return torch.device(mesh_device_type)


def to_mesh_device(t: torch.Tensor) -> torch.Tensor:
    """A DTensor moved where its mesh's collectives can read it (see :func:`collective_device`);
    the same tensor when it is there already or is not a DTensor."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return t
    target = collective_device(t.device, mesh.device_type)
    return t if target is None else t.to(target)


def all_reduce_sum(t: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_gather_object(obj, group: Optional[dist.ProcessGroup] = None) -> list:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def make_global_whiten(group: Optional[dist.ProcessGroup] = None, eps: float = 1e-8):
    """`masked_whiten` with mean / unbiased variance over the mask of ALL ranks in `group`.

    Same numbers as rlhf.algos.masked.masked_whiten on the concatenated batch.
    """

    def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # fp64 sums; padding may hold anything (even inf), so it is selected out, not multiplied by 0.
        x = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)).double()
        stats = torch.stack([x.sum(), (x * x).sum(), mask.double().sum()])
        all_reduce_sum(stats, group)
        n = stats[2]
        if n.item() < 2:
            raise ValueError(f"cannot whiten over {int(n.item())} response token(s); need at least 2")
        mean = stats[0] / n
        var = (stats[1] - n * mean * mean) / (n - 1)
        return ((values.double() - mean) * torch.rsqrt(var + eps)).to(values.dtype)

    return whiten
