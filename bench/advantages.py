"""Group advantage estimators: the vectorised grpo / rloo against a per-sample Python loop.

The baseline is the loop structure of verl's ``core_algos`` (a dict from prompt id to the
list of its scores, then one pass per sample), written here on the same tensors. Both run on
the same ``--samples`` outcome rewards (``--n`` samples per prompt, 0/1 scores, uneven
response lengths); the bench checks that the numbers agree (max abs difference) and prints
the median seconds of each and their ratio. Last line: one JSON object.

    python bench/advantages.py [--samples 65536] [--n 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rlhf.algos.advantages import get_adv_estimator  # noqa: E402


def loop_grpo(scores: torch.Tensor, index: list[int], mask: torch.Tensor, eps: float = 1e-6):
    groups: dict[int, list[torch.Tensor]] = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for k, v in groups.items():
        t = torch.stack(v)
        mean[k], std[k] = (t.mean(), t.std()) if len(v) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
    out = scores.clone()
    for i in range(len(scores)):
        out[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
    return out.unsqueeze(-1) * mask


def loop_rloo(scores: torch.Tensor, index: list[int], mask: torch.Tensor):
    groups: dict[int, list[torch.Tensor]] = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean = {k: torch.stack(v).mean() for k, v in groups.items()}
    out = scores.clone()
    for i in range(len(scores)):
        n = len(groups[index[i]])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
    return out.unsqueeze(-1) * mask


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=65536)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--length", type=int, default=64, help="response columns")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    B, T = a.samples, a.length
    scores = torch.randint(0, 2, (B,), generator=g).float()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = scores
    index = torch.arange(B // a.n).repeat_interleave(a.n)
    index_list = index.tolist()
    result = {"bench": "advantages", "samples": B, "n": a.n, "columns": T, "repeats": a.repeats,
              "torch": torch.__version__, "machine": platform.machine(), "threads": 1, "estimators": {}}
    for name, loop in (("grpo", lambda: loop_grpo(scores, index_list, mask)),
                       ("rloo", lambda: loop_rloo(scores, index_list, mask))):
        fn = get_adv_estimator(name)
        ours_s, ours = timed(lambda: fn(token_level_rewards=rewards, response_mask=mask, index=index)[0], a.repeats)
        loop_s, ref = timed(loop, max(1, a.repeats // 2))
        diff = float((ours - ref).abs().max())
        result["estimators"][name] = {"ours_s": ours_s, "loop_s": loop_s, "speedup": loop_s / ours_s,
                                      "max_abs_diff": diff}
        print(f"{name}: vectorised {ours_s * 1e3:.1f} ms, per-sample loop {loop_s * 1e3:.0f} ms, "
              f"{loop_s / ours_s:.0f}x; max |diff| {diff:.2e}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
