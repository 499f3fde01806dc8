"""R3 (rollout routing replay) against two sources of sampler/trainer routing mismatch, 1 CPU rank.

Variants on the tiny Qwen3-MoE of ``tests/_archs.py`` (the setup of
``tests/unit/test_rollout_routes.py``): a bf16 sampler against the fp32 trainer, and an fp32 sampler
whose routers are perturbed by N(0, 0.02). Per variant, with replay off and with R3: the fraction of
token-layer routes that differ (``moe/routing_mismatch``) and the max / mean |sampler - trainer|
log-prob over response tokens, then the gap ratio. The optional argument scales the routers first
(near-ties flip more easily).

Run::

    python bench/r3_precision.py          # routers as initialised
    python bench/r3_precision.py 0.1
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import tests.unit.test_rollout_routes as routes
    from tests._archs import tiny_model

    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    model = tiny_model("qwen3_moe", 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.mul_(scale)
    path = os.path.join(d, "model")
    model.save_pretrained(path, safe_serialization=True)
    for variant in ("bf16", "perturbed"):
        worker = routes._worker(mesh, path, "R3")
        kw = dict(dtype=torch.bfloat16) if variant == "bf16" else {}
        batch, _ = routes._rollout(worker, noise=0.0 if variant == "bf16" else 2e-2, **kw)
        mask = batch.response_mask
        runs = {}
        for mode in ("none", "R3"):
            worker.router_replay.replay = mode == "R3"
            lp, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=3, record_routes=True)
            gap = (lp - batch.rollout_log_probs.float()).abs() * mask
            runs[mode] = dict(gap_max=float(gap.max()), gap_mean=float(gap.sum() / mask.sum()),
                              **worker.router_replay.mismatch(torch.device("cpu")))
        none, r3 = runs["none"], runs["R3"]
        print(f"{variant} (router scale {scale}): flipped {none['moe/routing_mismatch']:.3f} -> R3 "
              f"{r3['moe/routing_mismatch']:.3f}; gap max {none['gap_max']:.4f} -> {r3['gap_max']:.4f} "
              f"(x{none['gap_max'] / r3['gap_max']:.2f}), mean {none['gap_mean']:.5f} -> {r3['gap_mean']:.5f} "
              f"(x{none['gap_mean'] / r3['gap_mean']:.2f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
