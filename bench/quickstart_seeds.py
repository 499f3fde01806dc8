"""Benchmark: what the CPU quickstart learns, as a mean and spread over seeds, not one run.

One quickstart run is one draw: the SFT warm start and GRPO both depend on the data order and
the sampler's draws, and a 0.8M-parameter model trained at a high learning rate amplifies
float rounding into visibly different models within a few dozen steps. So a claim about the
quickstart (docs/getting-started/quickstart.md and docs/benchmarks.md; a change to SFT, sampling or a loss) is made from this script.

For each seed ``k`` it runs the whole pipeline of ``launch/quickstart.sh`` on ``--nproc`` CPU
ranks: SFT with ``sft.seed=k trainer.seed=k``, then GRPO from that model with
``rollout.seed=k data.seed=k+1``; seed 0 is exactly the quickstart's defaults. Printed first:
the lowest SFT loss the teacher's demonstrations allow (:func:`sft_loss_floor`); then per
seed: the SFT loss (mean of the last ``--tail`` steps, every step logged, so one noisy batch
does not decide it), greedy val accuracy after SFT and after GRPO; then mean, sample std, min
and max of each. ``--sft-override`` / ``--grpo-override`` try another recipe on the same
seeds; ``--sft-model DIR`` skips SFT and starts every GRPO seed from one model (the GRPO
step's own spread).

Usage: ``python bench/quickstart_seeds.py [--seeds 5] [--nproc 2] [--sft-override sft.lr=2e-3]``.
The last printed line is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:5])} ... failed (exit {r.returncode}); see {log}:\n"
                         + log.read_text()[-3000:])
    return time.perf_counter() - t


def _torchrun(nproc: int, script: str, config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            script, "--config", config, *overrides]


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def sft_loss_floor(sft_file: Path, carry_error: float = 0.6) -> float:
    """The lowest mean per-token SFT loss any model can reach on the quickstart's demonstrations.

    The teacher's only randomness is one binary choice per carry problem (keep the carry with
    probability 1 - ``carry_error``; every later token follows from it), so the floor is that
    choice's entropy summed over carry problems, divided by all response tokens (the char
    tokenizer: one per character, plus EOS). A warm start near it has learnt the teacher's
    distribution; one well above it has not, and GRPO then has more to fix.
    """
    from rlhf.data.synthetic import AdditionProblem

    h = -(carry_error * math.log(carry_error) + (1 - carry_error) * math.log(1 - carry_error))
    carries = tokens = 0
    for line in sft_file.read_text().splitlines():
        row = json.loads(line)
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        carries += AdditionProblem(int(a), int(b)).has_carry
        tokens += len(row["response"]) + 1
    return carries * h / tokens


def one_seed(k: int, args, out: Path) -> dict:
    from rlhf.ops.metrics import read_metrics

    row: dict = {"seed": k}
    sft_model = args.sft_model
    if not sft_model:
        sft_dir = out / f"sft_{k}"
        row["sft_s"] = _run(_torchrun(args.nproc, "train_sft.py", args.sft_config, [
            f"model.path={args.init}", f"trainer.output_dir={sft_dir}", f"sft.seed={k}", f"trainer.seed={k}",
            "trainer.log_freq=1", "trainer.logger=[jsonl]", *args.sft_override]), out / f"sft_{k}.log")
        losses = [r["sft/loss"] for r in read_metrics(sft_dir / "metrics.jsonl") if "sft/loss" in r]
        row["sft_loss_tail"] = statistics.fmean(losses[-args.tail:])
        sft_model = str(sft_dir / "hf_export")
    grpo_dir = out / f"grpo_{k}"
    row["grpo_s"] = _run(_torchrun(args.nproc, "train_grpo.py", args.grpo_config, [
        f"model.path={sft_model}", f"trainer.output_dir={grpo_dir}", f"rollout.seed={k}", f"data.seed={k + 1}",
        *args.grpo_override]), out / f"grpo_{k}.log")
    summary = [r for r in read_metrics(grpo_dir / "metrics.jsonl") if "summary/val_acc_final" in r][-1]
    row["val_acc_sft"] = summary["summary/val_acc_initial"]
    row["val_acc_final"] = summary["summary/val_acc_final"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sft-config", default="configs/quickstart_sft.yaml")
    ap.add_argument("--grpo-config", default="configs/quickstart.yaml")
    ap.add_argument("--sft-override", nargs="*", default=[], help="extra SFT overrides, key=value")
    ap.add_argument("--grpo-override", nargs="*", default=[], help="extra GRPO overrides, key=value")
    ap.add_argument("--sft-model", default="", help="skip SFT: every seed's GRPO starts from this HF directory")
    ap.add_argument("--tail", type=int, default=25, help="SFT steps averaged for the SFT loss figure")
    ap.add_argument("--out", default="outputs/quickstart_seeds")
    args = ap.parse_args()

    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, args.init = ROOT / "data/addition", str(out / "init")
    _run([sys.executable, "-m", "rlhf.data.synthetic", "--out", str(data), "--n-sft", "8000"], out / "data.log")
    _run([sys.executable, "-m", "rlhf.models.tiny", "--out", args.init], out / "init.log")

    floor = sft_loss_floor(data / "sft.jsonl")
    print(f"SFT loss floor of the teacher's demonstrations: {floor:.4f} nats/token", flush=True)
    rows = []
    for k in range(args.first_seed, args.first_seed + args.seeds):
        rows.append(one_seed(k, args, out))
        r = rows[-1]
        print(f"seed {k}: sft loss (last {args.tail} steps) {r.get('sft_loss_tail', float('nan')):.4f} | "
              f"val acc after SFT {r['val_acc_sft']:.3f} -> after GRPO {r['val_acc_final']:.3f} | "
              f"sft {r.get('sft_s', 0):.0f} s, grpo {r['grpo_s']:.0f} s", flush=True)
    figures = {key: _stats([r[key] for r in rows]) for key in ("sft_loss_tail", "val_acc_sft", "val_acc_final")
               if key in rows[0]}
    for key, s in figures.items():
        print(f"{key}: mean {s['mean']:.4f}  std {s['std']:.4f}  min {s['min']:.4f}  max {s['max']:.4f}")
    print(json.dumps({"bench": "quickstart_seeds", "nproc": args.nproc, "sft_override": args.sft_override,
                      "grpo_override": args.grpo_override, "sft_model": args.sft_model, "sft_loss_floor": floor, "seeds": rows,
                      **figures, "load_avg_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
