"""Benchmark: sampled response tokens to first reach a greedy val accuracy, on-policy distillation vs GRPO.

Why tokens and not steps: the GRPO quickstart reaches ~1.0 greedy val accuracy within a few
steps, so steps say little; what distillation saves is sampling. Both methods start from the
same SFT warm start, on the same data and seeds (``trainer.seed``, ``rollout.seed``,
``data.seed``), validate greedily after every step (``trainer.test_freq=1``), and count every
sampled response token (``response_length/generated_mean`` x samples per step, the policy's
own tokens). A run stops as soon as it first reaches ``--target``; a run that never does
within ``--max-steps`` counts as "not reached" (its tokens so far are a lower bound).

GRPO: ``configs/quickstart.yaml`` (32 prompts x n=8; ``--methods grpo@2`` adds a run with n=2, a
baseline that samples fewer tokens per step). OPD: ``configs/quickstart_distill.yaml`` (32 prompts
x n=1, teacher = ``--teacher``, the GRPO quickstart's final model). ``--cross-tokenizer`` adds OPD
from that teacher under another tokenizer (``rlhf.models.tiny.write_permuted_vocab_copy``). The
harder 3-digit variant (``rlhf.data.addition3``) runs with ``--data data/addition3
--max-response-length 40`` and that task's own ``--sft-model`` and ``--teacher``
(docs/howto/distillation.md has the commands that build them).

Usage: ``python bench/distill_tokens.py --seeds 3 --sft-model outputs/quickstart/sft/hf_export
--teacher outputs/quickstart/grpo/hf_export``. The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tokens_to_target(records: list[dict], samples_per_step: int, target: float) -> tuple[float, int, bool]:
    """(sampled tokens up to the first step whose val/acc >= target, that step, reached) from metrics records.
    Step 0 is the warm start's own validation (0 tokens)."""
    by_step: dict[int, dict] = {}
    for r in records:
        by_step.setdefault(int(r.get("step", 0)), {}).update(r)
    tokens, last = 0.0, 0
    for step in sorted(by_step):
        r = by_step[step]
        tokens += r.get("response_length/generated_mean", 0.0) * samples_per_step if step > 0 else 0.0
        last = step
        if r.get("val/acc", -1.0) >= target:
            return tokens, step, True
    return tokens, last, False


def run_until(cmd: list[str], metrics: Path, log: Path, target: float, timeout_s: float) -> float:
    """Run one training command; end it (this process's own child) once val/acc reaches the target."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
        while proc.poll() is None:
            time.sleep(1.0)
            if metrics.is_file() and any(json.loads(line).get("val/acc", -1) >= target
                                         for line in metrics.read_text().splitlines() if line.strip()):
                os.killpg(proc.pid, 15)
                proc.wait()
                break
            if time.perf_counter() - t0 > timeout_s:
                os.killpg(proc.pid, 15)
                proc.wait()
                raise SystemExit(f"{cmd[4]} timed out after {timeout_s:.0f} s; see {log}")
        if proc.returncode not in (0, -15) and not metrics.is_file():
            raise SystemExit(f"run failed (exit {proc.returncode}); see {log}:\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def one_run(method: str, seed: int, args, out: Path) -> dict:
    from rlhf.ops.metrics import read_metrics

    run_dir = out / f"{method}_{seed}"
    if run_dir.exists():
        for p in sorted(run_dir.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    grpo = method.startswith("grpo")  # "grpo" (n = --grpo-n) or "grpo@N"
    config = "configs/quickstart.yaml" if grpo else "configs/quickstart_distill.yaml"
    unmapped = 0.0
    n = (int(method.split("@")[1]) if "@" in method else args.grpo_n) if grpo else args.opd_n
    overrides = [f"model.path={args.sft_model}", f"trainer.output_dir={run_dir}", f"trainer.seed={seed}",
                 f"rollout.seed={seed}", f"data.seed={seed + 1}", "trainer.test_freq=1",
                 f"trainer.total_training_steps={args.max_steps}", "checkpoint.export_hf=false",
                 "trainer.logger=[jsonl]", f"rollout.n={n}", f"data.train_batch_size={args.batch}",
                 f"data.train_files={args.data}/train.parquet", f"data.val_files={args.data}/val.parquet",
                 *([f"data.max_response_length={args.max_response_length}"] if args.max_response_length else [])]
    overrides += args.override
    if not grpo:
        overrides += args.opd_override
    if method == "opd":
        overrides.append(f"distill.teachers.teacher.path={args.teacher}")
    if method == "opd_cross_tokenizer":
        overrides += [f"distill.teachers.teacher.path={args.cross_teacher}", "algorithm.adv_estimator=opd",
                      "distill.enabled=true"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "train_grpo.py", "--config", config, *overrides]
    seconds = run_until(cmd, run_dir / "metrics.jsonl", out / f"{method}_{seed}.log", args.target, args.timeout_s)
    records = read_metrics(run_dir / "metrics.jsonl")
    tokens, step, reached = tokens_to_target(records, args.batch * n, args.target)
    row = {"method": method, "seed": seed, "tokens": tokens, "step": step, "reached": reached, "seconds": seconds,
           "val_acc_start": next((r["val/acc"] for r in records if r.get("step") == 0 and "val/acc" in r), None),
           "val_acc_last": [r["val/acc"] for r in records if "val/acc" in r][-1]}
    if not grpo:
        row["unmapped_tokens"] = sum(r.get("distill/unmapped_tokens", 0.0) for r in records)
        row["scored_tokens"] = sum(r.get("distill/scored_tokens", 0.0) for r in records)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="prompts per step (both methods)")
    ap.add_argument("--grpo-n", type=int, default=8)
    ap.add_argument("--opd-n", type=int, default=1)
    ap.add_argument("--data", default="data/addition")
    ap.add_argument("--max-response-length", type=int, default=0)
    ap.add_argument("--sft-model", default="outputs/quickstart/sft/hf_export")
    ap.add_argument("--teacher", default="outputs/quickstart/grpo/hf_export")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", default="outputs/distill_tokens")
    ap.add_argument("--override", nargs="*", default=[], help="extra overrides of every run")
    ap.add_argument("--opd-override", nargs="*", default=[], help="extra overrides of the distillation runs")
    ap.add_argument("--methods", nargs="*", default=["grpo", "opd"], help="grpo (n = --grpo-n), grpo@N (n = N), opd")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--cross-tokenizer", action="store_true",
                    help="also distil from the teacher under another (permuted-id) character tokenizer")
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    methods = list(args.methods)
    if args.cross_tokenizer:
        from rlhf.models.tiny import write_permuted_vocab_copy

        args.cross_teacher = str(write_permuted_vocab_copy(args.teacher, str(out / "cross_tokenizer_teacher")))
        methods.append("opd_cross_tokenizer")
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for method in methods:
            rows.append(one_run(method, seed, args, out))
            r = rows[-1]
            print(f"seed {seed} {method}: {r['tokens']:.0f} sampled tokens to val/acc >= {args.target} at step "
                  f"{r['step']}{'' if r['reached'] else ' (NOT reached: lower bound)'} ({r['seconds']:.0f} s)",
                  flush=True)
    mean = {m: statistics.fmean(r["tokens"] for r in rows if r["method"] == m) for m in methods}
    ratio = mean["opd"] / mean["grpo"] if mean.get("grpo") and "opd" in mean else float("nan")
    ratios = {f"opd/{m}": mean["opd"] / v for m, v in mean.items() if m.startswith("grpo") and v and "opd" in mean}
    print(f"mean sampled tokens to {args.target}: " + ", ".join(f"{m} {v:.0f}" for m, v in mean.items())
          + f"; OPD / GRPO = {ratio:.3f} (target <= 0.25)"
          + "".join(f"; {k} = {v:.3f}" for k, v in ratios.items() if k != "opd/grpo"))
    if args.cross_tokenizer:
        cross = [r for r in rows if r["method"] == "opd_cross_tokenizer"]
        print(f"cross-tokenizer teacher: {mean['opd_cross_tokenizer']:.0f} tokens; val acc "
              f"{statistics.fmean(r['val_acc_start'] for r in cross):.3f} -> "
              f"{statistics.fmean(r['val_acc_last'] for r in cross):.3f}; unmapped tokens "
              f"{sum(r['unmapped_tokens'] for r in cross):.0f} of {sum(r['scored_tokens'] for r in cross):.0f} scored")
    print(json.dumps({"bench": "distill_tokens", "target": args.target, "data": args.data, "nproc": args.nproc,
                      "override": args.override, "opd_override": args.opd_override, "batch": args.batch,
                      "tokens_mean": mean, "ratio_opd_over_grpo": ratio, "ratios": ratios,
                      "all_reached": all(r["reached"] for r in rows), "runs": rows,
                      "load_avg_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
