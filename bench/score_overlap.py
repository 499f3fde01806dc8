"""Scoring during generation (reward.score_during_generation) vs scoring after it, in one run.

    python bench/score_overlap.py                   # ~30 s on a 2-core CPU
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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tiny_run import add_shape_args, mean, tiny_grpo_rows  # noqa: E402

REWARD = '''
import time

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return float(len(solution_str) % 2)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, steps=4, batch=16, n=8, response=64)
    ap.add_argument("--reward-ms", type=float, default=5.0, help="cost of one reward call")
    ap.add_argument("--workers", type=int, default=2, help="reward.num_workers")
    args = ap.parse_args()
    from tests._assets import write_tiny_assets

    with tempfile.TemporaryDirectory() as tmp:
        assets = write_tiny_assets(Path(tmp) / "assets", n_train=256, n_val=16)
        f = Path(tmp) / "slow_reward.py"
        f.write_text(REWARD.format(seconds=args.reward_ms / 1000))
        after, during = (tiny_grpo_rows(assets, Path(tmp) / name, batch=args.batch, n=args.n, response=args.response,
                                        steps=args.steps, warmup=1, **{  # step 1 warms up
                                            "reward.reward_fn": f"{f}:slow", "reward.num_workers": args.workers,
                                            "reward.score_during_generation": overlap, "rollout.stop": "['c']"})
                         for name, overlap in (("after", False), ("during", True)))
    same = all(a[k] == b[k] for a, b in zip(after, during) for k in ("reward/mean", "response_length/mean"))
    gen, reward = mean(after, "timing/rollout"), mean(after, "timing/reward_fn")
    gen_score = {"after": gen + reward, "during": mean(during, "timing/rollout") + mean(during, "timing/reward_fn")}
    ideal = gen_score["after"] / max(gen, reward)  # perfect overlap hides the shorter phase
    step = {"after": mean(after, "timing/step"), "during": mean(during, "timing/step")}
    res = {"generate_plus_score_s_after": gen_score["after"], "generate_plus_score_s_during": gen_score["during"],
           "reward_fn_s_after": reward, "reward_fn_s_during": mean(during, "timing/reward_fn"),
           "step_s_after": step["after"], "step_s_during": step["during"],
           "speedup_generate_plus_score": gen_score["after"] / gen_score["during"],
           "speedup_step": step["after"] / step["during"], "speedup_ideal_overlap": ideal, "same_rewards": same,
           "config": vars(args)}
    print(f"generate + score per step: after {gen_score['after']:.2f} s (reward phase {res['reward_fn_s_after']:.2f} s), "
          f"during {gen_score['during']:.2f} s (reward phase {res['reward_fn_s_during']:.2f} s): "
          f"{res['speedup_generate_plus_score']:.2f}x (perfect overlap: {ideal:.2f}x); whole step {res['speedup_step']:.2f}x; same rewards: {same}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
