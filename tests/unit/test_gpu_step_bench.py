"""bench/gpu_step.py on CPU (``--device cpu --tiny``): the GPU benchmark's code runs between GPU leases."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_step_bench_runs_on_cpu_and_ends_with_its_fractions():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--device", "cpu", "--tiny"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("[rlhf] attention kernels: packed=reference")
    res = json.loads(lines[-1])
    for key in ("decode_roofline_fraction", "prefill_mfu", "update_mfu"):
        assert 0 < res[key] < math.inf, key
    # each decode step reads every weight once: the ideal time cannot exceed the measured one
    assert res["decode_roofline_fraction"] <= 1
    row = res["models"][0]
    assert row["decode_steps"] == row["response_max"] - 1 and row["response_max"] <= 24
    assert row["logprob_max_diff_vs_sdpa"] == 0.0  # CPU: both passes are the bucketed SDPA
    assert set(row["step_breakdown"]) == {"generate", "old_logprob", "ref_logprob", "update", "total"}
    assert row["generate_speedup_vs_hf"] > 0 and row["hf_tok_s"] > 0


def test_roofline_bytes_count_the_live_kv_once():
    """Two groups of 2: lengths (3, 1) and (2, 2), prompt 10. Own positions read: 1 + 2 (the 3-token response's
    two decode steps), 0, 1, 1; prompt blocks once per group per step with a live sample: 2 + 1 steps."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from gpu_step import kv_read_bytes, stop_ids
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert kv_read_bytes(10, [3, 1, 2, 2], 2, per_token=7) == 7 * (3 + 0 + 1 + 1 + 10 * (2 + 1))
    assert stop_ids(1000, 100.0) == list(range(990, 1000))
