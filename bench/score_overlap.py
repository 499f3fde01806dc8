"""Scoring during generation (reward.score_during_generation) vs scoring after it, in one run.

    python bench/score_overlap.py                   # ~2 min on a 2-core CPU
    python bench/score_overlap.py --reward-ms 5 --steps 4

A reward that costs ``--reward-ms`` per sample (a sleep in the worker process, standing in
for a sandboxed code run or a math-verify call) and a random tiny model whose responses
stop at different lengths (the long tail that leaves time to score the early finishers).
Both runs: 1 process, a pool of ``--workers`` reward workers, same seeds, so the same
responses and scores (checked). Printed: seconds of generation + reward phases per step
(``timing/rollout + timing/reward_fn``), the step time, the ratio, and the ratio perfect
overlap would give (the sum over the longer of the two phases). The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REWARD = '''
import time

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return float(len(solution_str) % 2)
'''


def _run(assets: Path, out: Path, reward: str, args, overlap: bool) -> list[dict]:
    from rlhf.metrics import read_metrics

    over = {"model.path": assets / "model", "data.train_files": assets / "data" / "train.parquet",
            "data.val_files": "", "data.max_prompt_length": 16, "data.max_response_length": args.response,
            "data.train_batch_size": args.batch, "rollout.n": args.n, "actor.ppo_mini_batch_size": args.batch,
            "actor.ppo_micro_batch_size_per_gpu": 64, "trainer.device": "cpu", "trainer.output_dir": out,
            "trainer.total_training_steps": args.steps, "checkpoint.save_freq": -1, "checkpoint.export_hf": False,
            "reward.reward_fn": reward, "reward.num_workers": args.workers,
            "reward.score_during_generation": overlap, "rollout.stop": "['c']"}
    cmd = [sys.executable, str(ROOT / "train_grpo.py")] + [f"{k}={v}" for k, v in over.items()]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        raise SystemExit(f"run failed:\n{r.stderr[-3000:]}")
    return [m for m in read_metrics(out / "metrics.jsonl") if "actor/loss" in m][1:]  # step 1 warms up


def _mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--response", type=int, default=64, help="max response tokens")
    ap.add_argument("--reward-ms", type=float, default=5.0, help="cost of one reward call")
    ap.add_argument("--workers", type=int, default=2, help="reward.num_workers")
    args = ap.parse_args()
    from tests._assets import write_tiny_assets

    with tempfile.TemporaryDirectory() as tmp:
        assets = write_tiny_assets(Path(tmp) / "assets", n_train=256, n_val=16)
        f = Path(tmp) / "slow_reward.py"
        f.write_text(REWARD.format(seconds=args.reward_ms / 1000))
        after = _run(assets, Path(tmp) / "after", f"{f}:slow", args, overlap=False)
        during = _run(assets, Path(tmp) / "during", f"{f}:slow", args, overlap=True)
    same = all(abs(a["reward/mean"] - b["reward/mean"]) < 1e-9 for a, b in zip(after, during))
    gen_score = {name: _mean(rows, "timing/rollout") + _mean(rows, "timing/reward_fn")
                 for name, rows in (("after", after), ("during", during))}
    # Perfect overlap hides the shorter of the two phases: the floor is the longer one.
    ideal = gen_score["after"] / max(_mean(after, "timing/rollout"), _mean(after, "timing/reward_fn"))
    step = {name: _mean(rows, "timing/step") for name, rows in (("after", after), ("during", during))}
    res = {"generate_plus_score_s_after": gen_score["after"], "generate_plus_score_s_during": gen_score["during"],
           "reward_fn_s_after": _mean(after, "timing/reward_fn"), "reward_fn_s_during": _mean(during, "timing/reward_fn"),
           "step_s_after": step["after"], "step_s_during": step["during"],
           "speedup_generate_plus_score": gen_score["after"] / gen_score["during"],
           "speedup_step": step["after"] / step["during"], "speedup_ideal_overlap": ideal, "same_rewards": same, "config": vars(args)}
    print(f"generate + score per step: after {gen_score['after']:.2f} s (reward phase {res['reward_fn_s_after']:.2f} s), "
          f"during {gen_score['during']:.2f} s (reward phase {res['reward_fn_s_during']:.2f} s): "
          f"{res['speedup_generate_plus_score']:.2f}x (perfect overlap: {ideal:.2f}x); whole step {res['speedup_step']:.2f}x; same rewards: {same}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
