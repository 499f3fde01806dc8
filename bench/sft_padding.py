"""Benchmark: padding-free SFT (``model.use_remove_padding: true``) vs padded batches, in one run.

Both runs are ``train_sft.py`` on the same data, model, seed and step count: the tools
quickstart's multi-turn calculator demonstrations (``rlhf.data.arithmetic``, lengths 17-143
tokens) and its 0.8M-parameter model, under torchrun on ``--nproc`` CPU ranks. Printed per
run: the wall time of the whole command, the time of the training steps alone (first to last
logged step, from ``metrics.jsonl``), the loss at the first logged step (the same batch
through both paths: equal up to float rounding) and at the end, and the share of padding
in the padded micro-batches; then the ratios padded / padding-free.

Usage: ``python bench/sft_padding.py [--rows 2400] [--nproc 2] [--micro 16]``; the last
printed line is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def pad_share(data_dir: Path, model_dir: Path, rows: int, micro: int) -> float:
    """Share of pad positions in padded micro-batches of the rows in file order (generated in random order)."""
    from rlhf.models.loading import load_tokenizer
    from rlhf.train.sft import SFTSettings, _read_rows, tokenize_sft

    tok = load_tokenizer(str(model_dir))
    examples, _ = tokenize_sft(_read_rows(str(data_dir / "sft.jsonl"))[:rows], tok,
                               SFTSettings(max_length=192, tool_config_path=str(ROOT / "configs/tools/calculator.yaml")))
    lens = [len(p) + len(r) for p, r, _ in examples]
    slots = real = 0
    for i in range(0, len(lens), micro):
        chunk = lens[i:i + micro]
        slots, real = slots + max(chunk) * len(chunk), real + sum(chunk)
    return 1 - real / slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2400, help="demonstrations (one epoch)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro", type=int, default=16, help="rows per rank per step")
    args = ap.parse_args()
    from rlhf.ops.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="bench_sft_") as tmp:
        tmp = Path(tmp)
        _run([sys.executable, "-m", "rlhf.data.arithmetic", "--out", str(tmp / "data"), "--n-sft", str(args.rows)])
        _run([sys.executable, "-m", "rlhf.models.tiny", "--out", str(tmp / "init")])
        result: dict = {"bench": "sft_padding", "rows": args.rows, "nproc": args.nproc, "micro": args.micro,
                        "cpu_count": os.cpu_count(), "pad_share": pad_share(tmp / "data", tmp / "init", args.rows,
                                                                            args.micro)}
        for packed in (False, True):
            out = tmp / f"packed_{packed}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   str(ROOT / "train_sft.py"), "--config", str(ROOT / "configs/quickstart_tools_sft.yaml"),
                   f"model.path={tmp / 'init'}", f"sft.train_files={tmp / 'data' / 'sft.jsonl'}",
                   f"sft.train_batch_size={args.micro * args.nproc}", f"sft.micro_batch_size_per_gpu={args.micro}",
                   "sft.total_epochs=1", "trainer.log_freq=5", f"model.use_remove_padding={str(packed).lower()}",
                   f"trainer.output_dir={out}"]
            wall = _run(cmd)
            rows = read_metrics(out / "metrics.jsonl")
            name = "packed" if packed else "padded"
            result[name] = {"wall_s": wall, "steps_s": rows[-1]["time"] - rows[0]["time"], "steps": rows[-1]["step"],
                            "first_loss": rows[0]["sft/loss"], "last_loss": rows[-1]["sft/loss"]}
            r = result[name]
            print(f"{name:7s}: wall {r['wall_s']:7.1f} s  steps {r['steps_s']:7.1f} s ({r['steps']} steps)  "
                  f"loss step 5 {r['first_loss']:.4f}  last {r['last_loss']:.4f}", flush=True)
        result["ratio_wall"] = result["padded"]["wall_s"] / result["packed"]["wall_s"]
        result["ratio_steps"] = result["padded"]["steps_s"] / result["packed"]["steps_s"]
        print(f"pad share of the padded micro-batches {result['pad_share']:.2f}; padded / padding-free: "
              f"wall {result['ratio_wall']:.2f}x, steps {result['ratio_steps']:.2f}x")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
