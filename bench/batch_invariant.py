"""Benchmark: the step cost of ``rollout.batch_invariant`` against the default, in one run.

Three GRPO trainers on the CPU quickstart's model size (the tiny Qwen2: hidden 128, 4 layers, random
weights; the addition task), built in this process and stepped in turn, so a noisy shared machine hits
them alike:

* ``default``: the project's kernels (fused decode attention, packed training forward), and the
  old-log-prob pass;
* ``invariant+pass``: ``rollout.batch_invariant=true`` with the old-log-prob pass kept (the audit:
  ``mismatch/max_abs_logprob_diff`` measured every step);
* ``invariant``: ``rollout.batch_invariant=true actor.use_rollout_log_probs=true``: the pass skipped,
  the sampler's log-probs are the old ones.

Per configuration: the median over steps (the first, warm-up, dropped) of ``timing/step`` and of its
phases (generate, logprobs, update), and the ratio of each to the default; plus the largest
``mismatch/max_abs_logprob_diff`` the audit saw (0 when the mode holds).

Usage: ``OMP_NUM_THREADS=1 python bench/batch_invariant.py [--steps 6] [--batch 16] [--n 8]`` (one thread per
process, as launch/quickstart.sh runs); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "default": [],
    "invariant+pass": ["rollout.batch_invariant=true"],
    "invariant": ["rollout.batch_invariant=true", "actor.use_rollout_log_probs=true"],
}
PHASES = ("timing/step", "timing/generate", "timing/logprobs", "timing/update")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration (the first is warm-up)")
    ap.add_argument("--batch", type=int, default=16, help="data.train_batch_size (prompts per step)")
    ap.add_argument("--n", type=int, default=8, help="rollout.n")
    ap.add_argument("--response", type=int, default=32, help="data.max_response_length")
    args = ap.parse_args()

    import torch

    from rlhf.config.load import load_config
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model
    from rlhf.train.trainer import RLTrainer

    tmp = Path(tempfile.mkdtemp(prefix="bench_bi_"))
    write_tiny_model(str(tmp / "model"))  # the quickstart's size
    make_addition_task(tmp / "data", n_train=max(64, args.batch * args.steps), n_val=8, n_sft=0, seed=0)
    trainers = {}
    for name, extra in CONFIGS.items():
        cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), [
            f"model.path={tmp / 'model'}", f"data.train_files={tmp / 'data' / 'train.parquet'}",
            f"data.val_files={tmp / 'data' / 'val.parquet'}", "trainer.test_freq=-1", "trainer.logger=[]",
            f"data.train_batch_size={args.batch}", f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.batch // 2}",
            f"data.max_response_length={args.response}", f"trainer.total_training_steps={args.steps}",
            f"trainer.output_dir={tmp / name}", "checkpoint.export_hf=false", *extra])
        trainers[name] = RLTrainer(cfg)
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for step in range(1, args.steps + 1):
        for name, trainer in trainers.items():  # interleaved: the same machine load for each
            rows[name].append(trainer.train_step(step))
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    out: dict = {"steps": args.steps, "batch": args.batch, "n": args.n, "threads": torch.get_num_threads(),
                 "loadavg": load, "configs": {}}
    for name, rs in rows.items():
        kept = rs[1:] if len(rs) > 1 else rs
        med = {k: statistics.median(r.get(k, 0.0) for r in kept) for k in PHASES}
        diffs = [r["mismatch/max_abs_logprob_diff"] for r in rs if "mismatch/max_abs_logprob_diff" in r]
        out["configs"][name] = {**{k.split("/")[1] + "_s": v for k, v in med.items()},
                                "max_abs_logprob_diff": max(diffs) if diffs else None}
    base = out["configs"]["default"]
    for name, c in out["configs"].items():
        c["step_ratio"] = c["step_s"] / base["step_s"]
        print(f"{name:15s} step {c['step_s']:.3f} s ({c['step_ratio']:.2f}x default)  generate {c['generate_s']:.3f}  "
              f"logprobs {c['logprobs_s']:.3f}  update {c['update_s']:.3f}  max|diff| {c['max_abs_logprob_diff']}")
    print(f"load average {' '.join(load)}; {time.strftime('%Y-%m-%d')}")
    for t in trainers.values():
        t.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
