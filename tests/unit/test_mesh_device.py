"""Where a tensor must be before a collective on a mesh (rlhf.models.parallel.collective_device).

FSDP2 CPU offload (``model.param_offload``) keeps parameter shards in host memory; NCCL
reads device memory only, so a rollout reshard / export of such shards must move each one
to the mesh's device before its all-gather. The rule is a function of the two device kinds,
so it is tested here without a GPU (tests/dist/test_shard_init.py runs the offload path)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, distribute_tensor

from rlhf.models.parallel import collective_device, to_mesh_device


def test_host_shards_move_to_the_device_of_a_cuda_mesh():
    assert collective_device(torch.device("cpu"), "cuda") == torch.device("cuda")  # the current GPU
    assert collective_device(torch.device("cuda", 1), "cuda") is None
    assert collective_device(torch.device("cpu"), "cpu") is None  # gloo reads host memory
    assert collective_device(torch.device("cuda", 0), "cpu") == torch.device("cpu")


def test_a_tensor_already_on_the_mesh_device_is_not_copied(mesh):
    t = distribute_tensor(torch.arange(4.0), mesh["dp"], [Replicate()])
    assert to_mesh_device(t) is t
    plain = torch.ones(2)
    assert to_mesh_device(plain) is plain
