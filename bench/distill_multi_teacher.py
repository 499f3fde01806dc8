"""Benchmark: two teachers by data_source on a two-task dataset, 2 ranks; each task's val accuracy.

The quickstart's addition prompts split into two tasks by the first operand's parity
(``addition/even``, ``addition/odd``). ``addition/even`` goes to the GRPO quickstart's final model;
``addition/odd`` to the same model under another tokenizer (``rlhf.models.tiny.write_permuted_vocab_copy``:
its characters take other ids, so that teacher runs the cross-tokenizer path). The student is the SFT
warm start. Printed: each task's greedy val accuracy before and after, the per-teacher ``distill/*``
metrics of the last step, and one JSON line.

Usage: ``python bench/distill_multi_teacher.py [--steps 6] [--nproc 2]`` (after launch/quickstart_distill.sh
or launch/quickstart.sh has built outputs/quickstart/sft and outputs/quickstart/grpo).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def split_task(src: Path, dst: Path) -> None:
    """The addition task's train / val parquet with data_source addition/even or addition/odd."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("train", "val"):
        rows = pq.read_table(src / f"{name}.parquet").to_pylist()
        for r in rows:
            first = int(r["prompt"][0]["content"].split("+")[0])
            r["data_source"] = "addition/even" if first % 2 == 0 else "addition/odd"
        pq.write_table(pa.Table.from_pylist(rows), dst / f"{name}.parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sft-model", default="outputs/quickstart/sft/hf_export")
    ap.add_argument("--teacher", default="outputs/quickstart/grpo/hf_export")
    ap.add_argument("--out", default="outputs/distill_multi_teacher")
    args = ap.parse_args()
    from rlhf.models.tiny import write_permuted_vocab_copy
    from rlhf.ops.metrics import read_metrics

    out = (ROOT / args.out).resolve()
    run_dir = out / "run"
    if run_dir.exists():
        for p in sorted(run_dir.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    split_task(ROOT / "data/addition", out / "data")
    odd_teacher = write_permuted_vocab_copy(str(ROOT / args.teacher), str(out / "teacher_odd"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "train_grpo.py", "--config", "configs/quickstart_distill.yaml", f"model.path={args.sft_model}",
           f"data.train_files={out / 'data/train.parquet'}", f"data.val_files={out / 'data/val.parquet'}",
           "reward.reward_fn=gsm8k", f"trainer.output_dir={run_dir}", f"trainer.total_training_steps={args.steps}",
           f"trainer.test_freq={args.steps}", "checkpoint.export_hf=false", "trainer.logger=[jsonl]",
           f"distill.teachers.teacher.path={args.teacher}", f"distill.teachers.odd.path={odd_teacher}",
           "distill.data_source_teacher={addition/even: teacher, addition/odd: odd}"]
    t0 = time.perf_counter()
    with (out / "run.log").open("w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    if r.returncode:
        raise SystemExit(f"run failed (exit {r.returncode}); see {out / 'run.log'}")
    seconds = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    vals = [m for m in rows if "val/acc" in m]
    first, last = vals[0], vals[-1]
    steps = [m for m in rows if "distill/reverse_kl" in m]
    figures = {"seconds": seconds, "load_avg_1m": os.getloadavg()[0]}
    for task in ("addition/even", "addition/odd"):
        a, b = first[f"val/{task}/pass@1"], last[f"val/{task}/pass@1"]
        figures[task] = {"val_acc_before": a, "val_acc_after": b}
        print(f"{task}: greedy val acc {a:.3f} -> {b:.3f}")
    for name in ("teacher", "odd"):
        keys = ("reverse_kl", "teacher_logprob_mean", "scored_tokens", "unmapped_tokens")
        figures[name] = {k: steps[-1][f"distill/{name}/{k}"] for k in keys}
        figures[name]["reverse_kl_first"] = steps[0][f"distill/{name}/reverse_kl"]
        print(f"teacher {name}: reverse KL {figures[name]['reverse_kl_first']:.4f} -> "
              f"{figures[name]['reverse_kl']:.4f}, unmapped tokens {figures[name]['unmapped_tokens']:.0f}")
    print(json.dumps({"bench": "distill_multi_teacher", "steps": args.steps, "nproc": args.nproc, **figures}))


if __name__ == "__main__":
    main()
