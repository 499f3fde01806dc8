"""Benchmark: speculative decoding with n-gram drafts (``rollout.speculative``) on the quickstarts.

Runs the real GRPO training script for a few steps on the addition quickstart (configs/quickstart.yaml,
single turn) and the tools quickstart (configs/quickstart_tools.yaml, calculator calls, multi-turn),
each with ``rollout.speculative.enable`` false and true, and reads the rollout metrics of every
step from metrics.jsonl: the acceptance rate, the tokens a sequence gains per decode forward, the
generation time and tokens/s. Seeds are the same, so both runs sample the same tokens (speculation
is exact), and the figures compare the same work. Prints the medians over the steps after the
first (warm-up) and their ratio; the last line is one JSON object.

Prerequisites: the quickstarts' SFT warm starts (``bash launch/quickstart.sh`` and
``launch/quickstart_tools.sh``, or their first steps: data, tiny model, ``train_sft.py``).

Usage: ``python bench/speculative.py [--steps 4] [--nproc 1] [--drafts 4] [--quickstarts addition tools]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"addition": "configs/quickstart.yaml", "tools": "configs/quickstart_tools.yaml"}
KEYS = ("rollout/tokens_per_s", "timing/generate", "rollout/decode_steps", "rollout/tokens_generated",
        "rollout/spec_acceptance_rate", "rollout/spec_tokens_per_forward")


def run(config: str, steps: int, nproc: int, out: Path, overrides: list[str]) -> list[dict]:
    """Train ``steps`` GRPO steps; the per-step rollout metrics."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "train_grpo.py", "--config", config, f"trainer.total_training_steps={steps}",
           "trainer.val_before_train=false", "trainer.test_freq=1000", f"trainer.output_dir={out}", *overrides]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: row[k] for k in KEYS if k in row} for row in rows if "rollout/tokens_per_s" in row]


def median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows[1:] or rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--drafts", type=int, default=4, help="rollout.speculative.num_draft_tokens")
    ap.add_argument("--quickstarts", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--override", nargs="*", default=[], help="more overrides of both runs (e.g. rollout.speculative.ngram_min=2)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_speculative_"))
    result: dict = {"steps": args.steps, "nproc": args.nproc, "drafts": args.drafts, "override": args.override}
    for name in args.quickstarts:
        fig = {}
        for on in (False, True):
            over = [f"rollout.speculative.enable={str(on).lower()}",
                    f"rollout.speculative.num_draft_tokens={args.drafts}", *args.override]
            rows = run(CONFIGS[name], args.steps, args.nproc, tmp / f"{name}_{'on' if on else 'off'}", over)
            fig["on" if on else "off"] = {k.split("/")[1]: median(rows, k) for k in KEYS}
        off, on = fig["off"], fig["on"]
        fig["tokens_per_s_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
        fig["generate_time_ratio"] = off["generate"] / on["generate"]
        fig["decode_steps_ratio"] = off["decode_steps"] / on["decode_steps"]
        print(f"{name}: acceptance {on['spec_acceptance_rate']:.3f}, tokens/forward {on['spec_tokens_per_forward']:.2f}, "
              f"decode steps {off['decode_steps']:.0f} -> {on['decode_steps']:.0f}, generate {off['generate']:.2f} s -> "
              f"{on['generate']:.2f} s, tokens/s {off['tokens_per_s']:.0f} -> {on['tokens_per_s']:.0f} "
              f"(x{fig['tokens_per_s_ratio']:.2f}); same tokens: {off['tokens_generated'] == on['tokens_generated']}")
        result[name] = fig
    print(json.dumps(result))


if __name__ == "__main__":
    main()
