"""Unit-tier fixtures."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A 1-process (pp, dp, tp) = (1, 1, 1) gloo mesh, for workers that expect a mesh."""
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
