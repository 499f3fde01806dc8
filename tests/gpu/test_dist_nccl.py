"""The multi-process tier on nccl, one GPU per rank (needs 2+ GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu._gpu import GPU

pytestmark = GPU + [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs for nccl ranks")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", [
    "tests/dist/test_grpo_equivalence.py",   # dp2 update == dp1
    "tests/dist/test_global_whiten.py",
    "tests/dist/test_reshard_layouts.py",    # rollout tp != train tp
    "tests/dist/test_shard_init.py",         # only shards reach the GPU; param_offload shards reshard over nccl
    "tests/dist/test_regroup.py",            # dynamic sampling rows through all_to_all on nccl
    # rollout rows: packed int32, all_to_all_single with uneven splits on nccl
    "tests/dist/test_exchange.py::test_rollout_rows_reach_only_the_ranks_that_train_on_them_packed_narrow",
])
def test_dist_tier_on_nccl(target):
    env = dict(os.environ, RLHF_DIST_DEVICE="cuda")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", target], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-1000:]
