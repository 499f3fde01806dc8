"""Reward scoring throughput: the in-process serial loop vs the worker pool, on math-verify.

    python bench/reward_pool.py [--samples 2048] [--workers 1,2,4]

The batch is MATH-style responses ending in a ``\\boxed{}`` answer, judged by the registered
``math`` reward (math-verify: LaTeX parsed to sympy, equivalence tested), a reward slow
enough for the process boundary to be worth it. Responses are a fixed mix of equivalent
forms (``\\frac{3}{4}`` vs ``0.75``, ``2\\sqrt{2}`` vs ``\\sqrt{8}``, intervals, percents) and
wrong answers. Each configuration scores the same batch; samples/s are the median of
``--repeats`` runs, and the pool's scores are checked equal to the serial ones. Pool start-up
(worker processes importing the reward) is timed apart: the trainer pays it once per run.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.advantages import timed  # noqa: E402  (median seconds of repeated calls)
from rlhf.rewards.pool import RewardPool  # noqa: E402
from rlhf.rewards.registry import get_reward_fn  # noqa: E402
from rlhf.rewards.scoring import score_responses  # noqa: E402

# (answer written by the "model", ground truth)
FORMS = [("\\frac{3}{4}", "0.75"), ("2\\sqrt{2}", "\\sqrt{8}"), ("[1, 3)", "[1,3)"), ("50\\%", "0.5"),
         ("\\dfrac{1}{3}", "1/3"), ("x^2 + 2x + 1", "(x+1)^2"), ("\\pi/2", "\\frac{\\pi}{2}"), ("7", "8"),
         ("\\{1, 2\\}", "\\{2, 1\\}"), ("12", "12.0"), ("\\frac{5}{6}", "\\frac{6}{5}"), ("3^{4}", "81")]


def make_batch(n: int) -> tuple[list[str], list[str], list[str]]:
    texts, gts = [], []
    for i in range(n):
        ans, gt = FORMS[i % len(FORMS)]
        texts.append(f"Step {i}: we simplify the expression carefully and obtain the result. "
                     f"So the final answer is $\\boxed{{{ans}}}$.")
        gts.append(gt)
    return texts, gts, ["math"] * n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    texts, gts, dss = make_batch(args.samples)
    fn = get_reward_fn("math")
    serial_s, serial = timed(lambda: score_responses(fn, texts, gts, dss), args.repeats)
    rows = [{"config": "serial (in process)", "seconds": serial_s, "samples_per_s": args.samples / serial_s,
             "startup_s": 0.0, "vs_serial": 1.0}]
    for k in (int(w) for w in args.workers.split(",")):
        t = time.perf_counter()
        with RewardPool("math", num_workers=k, timeout_s=30) as pool:
            pool.score(texts[:k], gts[:k], dss[:k])  # every worker has loaded the reward
            startup = time.perf_counter() - t
            s, res = timed(lambda: pool.score(texts, gts, dss), args.repeats)
        assert res.scores.tolist() == serial.scores.tolist() and res.n_timeouts == 0
        rows.append({"config": f"pool, {k} workers", "seconds": s, "samples_per_s": args.samples / s,
                     "startup_s": startup, "vs_serial": serial_s / s})
    print(f"{args.samples} samples, math-verify, {os.cpu_count()} CPUs, accuracy "
          f"{float(serial.scores.mean()):.3f}")
    print("| scorer | seconds | samples/s | start-up (s) | vs serial |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['seconds']:.2f} | {r['samples_per_s']:.0f} | {r['startup_s']:.2f} "
              f"| {r['vs_serial']:.2f}x |")
    print(json.dumps({"samples": args.samples, "cpus": os.cpu_count(), "rows": rows}))


if __name__ == "__main__":
    main()
