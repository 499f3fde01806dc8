"""The update with zero-advantage rows skipped (``actor.skip_zero_advantage_rows``) vs every row, quickstart shape.

On 2 gloo ranks (CPU, one thread each, as ``launch/quickstart.sh``): the quickstart's tiny Qwen2 and one
step's batch (``bench/update_fixed_costs.quickstart_batch``: 32 prompts x n = 8, two mini-batches of 64
rows per rank), with the advantages of a share ``--zero`` of the groups set to 0, as GRPO gives a group
whose samples all got the same reward (half of the quickstart's groups at its start, most of them late).
The old-log-prob pass, then ``update_policy`` with the trainer's ``old_log_probs_current=True``, skip off
and on alternated in one run. Reports medians of this rank's CPU seconds per update (less sensitive to
other jobs than wall time), their ratio, and the largest parameter and metric differences between the two
(they must agree to fp32 rounding: same step, same metrics).

Run:  python bench/zero_adv_rows.py [--zero 0.5 0.75 0.9] [--repeats 5]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.update_fixed_costs import join_gloo, quickstart_batch, run_two_ranks  # noqa: E402


def worker_main(rank: int, world: int, port: int, model_dir: str, zeros: list, repeats: int, out: str) -> None:
    join_gloo(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    results = {}
    for zero in zeros:
        batch = quickstart_batch(102)
        groups = len(batch) // 8
        g = torch.Generator().manual_seed(1)
        zero_groups = torch.randperm(groups, generator=g)[:round(zero * groups)]
        rows = (zero_groups[:, None] * 8 + torch.arange(8)).flatten()
        batch.advantages[rows] = 0.0
        n = len(batch) // world
        local = batch.select(list(range(rank * n, (rank + 1) * n)))
        res = {}
        for skip in (False, True):
            torch.manual_seed(0)
            actor = ActorConfig(lr=1e-4, ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=128,
                                log_prob_micro_batch_size_per_gpu=128, loss_agg_mode="token-mean",
                                skip_zero_advantage_rows=skip)
            w = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=True), mesh, torch.device("cpu"),
                             actor_cfg=actor, total_steps=100)
            local.old_log_probs, _ = w.compute_log_probs(local, temperature=1.0, micro_batch_size=128)
            res[skip] = {"w": w, "state": {k: v.detach().clone() for k, v in w.model.state_dict().items()}, "cpu": []}
        for rep in range(repeats + 1):  # the first repeat warms up; every repeat starts from the same weights
            for skip in (False, True) if rep % 2 == 0 else (True, False):
                r = res[skip]
                w = r["w"]
                with torch.no_grad():
                    for k, v in w.model.state_dict().items():
                        v.copy_(r["state"][k])
                w.optimizer.state.clear()
                dist.barrier()
                c0 = time.process_time()
                m = w.update_policy(local, mini_batch_rows=n // 2, temperature=1.0, max_response_length=32,
                                    old_log_probs_current=True)
                if rep:
                    r["cpu"].append(time.process_time() - c0)
                r["metrics"] = m
        off, on = res[False], res[True]
        param_diff = max(float((a.full_tensor() - b.full_tensor()).abs().max())
                         for a, b in zip(off["w"].model.parameters(), on["w"].model.parameters()))
        metric_diff = max(abs(v - on["metrics"][k]) / max(1.0, abs(v)) for k, v in off["metrics"].items())
        results[str(zero)] = {"update_cpu_s_all_rows": statistics.median(off["cpu"]),
                              "update_cpu_s_skip": statistics.median(on["cpu"]),
                              "max_param_diff": param_diff, "max_metric_rel_diff": metric_diff}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=float, nargs="+", default=[0.5, 0.75, 0.9], help="shares of zero-advantage groups")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="", help="HF model dir (default: a fresh quickstart-shaped tiny model)")
    args = ap.parse_args()
    summary = run_two_ranks(worker_main, args.model, args.zero, args.repeats)
    summary["loadavg"] = os.getloadavg()
    for zero, s in summary.items():
        if zero != "loadavg":
            print(f"zero-advantage groups {float(zero):.0%}: update cpu {s['update_cpu_s_all_rows']:.3f} s -> "
                  f"{s['update_cpu_s_skip']:.3f} s ({s['update_cpu_s_all_rows'] / s['update_cpu_s_skip']:.2f}x); "
                  f"max param diff {s['max_param_diff']:.2e}, max metric rel diff {s['max_metric_rel_diff']:.2e}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
