"""Shared by the benchmarks that compare two configs of the same tiny GRPO run (async.py, score_overlap.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_grpo_rows(assets: Path, out: Path, *, batch: int, n: int, response: int, steps: int, warmup: int,
                   nproc: int = 1, **over) -> list[dict]:
    """Run train_grpo.py on ``tests._assets`` (``nproc`` > 1: under torchrun) with one mini-batch of
    ``batch`` prompts x ``n`` samples per step and ``over`` overrides; the training steps' metric
    rows after the first ``warmup``."""
    from rlhf.ops.metrics import read_metrics

    cfg = {"model.path": assets / "model", "data.train_files": assets / "data" / "train.parquet",
           "data.val_files": "", "data.max_prompt_length": 16, "data.max_response_length": response,
           "data.train_batch_size": batch, "rollout.n": n, "actor.ppo_mini_batch_size": batch,
           "actor.ppo_micro_batch_size_per_gpu": 64, "trainer.device": "cpu", "trainer.output_dir": out,
           "trainer.total_training_steps": steps, "checkpoint.save_freq": -1, "checkpoint.export_hf": False, **over}
    launch = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launch + [str(ROOT / "train_grpo.py")] + [f"{k}={v}" for k, v in cfg.items()]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise SystemExit(f"run in {out} failed:\n{r.stderr[-3000:]}")
    return [m for m in read_metrics(out / "metrics.jsonl") if "actor/loss" in m][warmup:]


def mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


def add_shape_args(ap, *, steps: int, batch: int, n: int, response: int) -> None:
    """The run-shape options of :func:`tiny_grpo_rows`, with this benchmark's defaults."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=batch, help="prompts per step")
    ap.add_argument("--n", type=int, default=n, help="samples per prompt")
    ap.add_argument("--response", type=int, default=response, help="max response tokens")
