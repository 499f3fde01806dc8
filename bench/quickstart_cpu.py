"""The quickstart's GRPO step in CPU seconds per phase and rank, two settings back to back (default: skipping
zero-advantage rows off, then on).

Wall time on a shared machine measures the other jobs; a rank's CPU time does not (much). On 2 ranks with a
core each, a rank's CPU seconds per step are close to the idle machine's wall time: gloo waits spin, so a rank
that waits for the other still counts the time (main at 2026-11-26: 0.603 s CPU vs 0.596 s idle wall per step).
Each run is ``train_grpo.py --config configs/quickstart.yaml`` from ``--sft-model`` (e.g. the SFT export of
``launch/quickstart.sh`` or ``bench/quickstart_seeds.py``) with ``rollout.seed=k data.seed=k+1`` as
``bench/quickstart_seeds.py`` runs its seed k; the per-phase CPU time (update, old-log-prob pass, rollout =
reshard + generate + score, the whole step) is recorded around the trainer's methods on every rank.

Run:  python bench/quickstart_cpu.py --sft-model DIR [--seed 0] [--a actor.skip_zero_advantage_rows=false]
      [--b actor.skip_zero_advantage_rows=true]          (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(out: str, overrides: list[str]) -> None:
    """One rank of the GRPO run (under torchrun), timing the phases with time.process_time."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    tr = RLTrainer(load_config(str(ROOT / "configs/quickstart.yaml"), [f"trainer.output_dir={out}", *overrides]))
    rank = dist.get_rank()
    rec: dict[str, list[float]] = {"update": [], "logprobs": [], "rollout": [], "step": []}

    def timed(obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            t = time.process_time()
            r = fn(*a, **k)
            rec[key].append(time.process_time() - t)
            return r
        setattr(obj, attr, wrapper)

    timed(tr.actor, "update_policy", "update")
    timed(tr.actor, "compute_log_probs", "logprobs")
    timed(tr, "collect_rollouts", "rollout")
    timed(tr, "train_step", "step")
    summary = tr.fit()
    with open(f"{out}/cpu_rank{rank}.json", "w") as f:
        json.dump({"phases": rec, "val_acc_final": summary.get("summary/val_acc_final"),
                   "val_acc_initial": summary.get("summary/val_acc_initial")}, f)


def run(sft_model: str, seed: int, overrides: list[str], out: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--child", out,
           f"model.path={sft_model}", f"rollout.seed={seed}", f"data.seed={seed + 1}", "checkpoint.export_hf=false",
           *overrides]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"run failed ({overrides}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    ranks = [json.load(open(f"{out}/cpu_rank{k}.json")) for k in (0, 1)]
    phases = {k: max(statistics.median(rk["phases"][k]) for rk in ranks) for k in ranks[0]["phases"]}  # slower rank
    return {"cpu_s_per_step": phases, "update_share": phases["update"] / phases["step"],
            "val_acc_initial": ranks[0]["val_acc_initial"], "val_acc_final": ranks[0]["val_acc_final"]}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return _child(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-model", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--a", nargs="*", default=["actor.skip_zero_advantage_rows=false"], help="baseline overrides")
    ap.add_argument("--b", nargs="*", default=["actor.skip_zero_advantage_rows=true"], help="compared overrides")
    args = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in (("a", args.a), ("b", args.b)):
            res[name] = {"overrides": over, **run(args.sft_model, args.seed, over, os.path.join(tmp, name))}
            s = res[name]
            print(f"{' '.join(over) or '(defaults)'}: CPU s per step " +
                  ", ".join(f"{k} {v:.3f}" for k, v in s["cpu_s_per_step"].items()) +
                  f"; update share {s['update_share']:.0%}; val acc {s['val_acc_initial']:.3f} -> {s['val_acc_final']:.3f}",
                  flush=True)
    a, b = res["a"]["cpu_s_per_step"], res["b"]["cpu_s_per_step"]
    print(f"b / a: step {b['step'] / a['step']:.3f}, update {b['update'] / a['update']:.3f}")
    print(json.dumps({**res, "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
