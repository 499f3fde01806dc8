"""Benchmark: the fused CPU decode-attention kernel (``rlhf.rollout.cpu_attention``) vs the torch ops it
replaces (the gather kernel's ``baddbmm`` + fp32 softmax + ``bmm`` over the (slot, kv head) pairs), one
layer's call, in one run.

Shapes: the tiny GRPO step of ``bench/sampler.py`` (128 slots, G = 2, D = 32, a 24-column prompt read from
each group's lead), the 100M model's and Qwen2.5-0.5B's heads (G = 6-7, D = 64) at 24-2048 columns, long
shared prompts (256 and 1024 columns, n = 8) and D = 128. Random fp32 slot regions; every slot sees all its
columns; hot caches (the same regions every call). Figures: best of ``--repeats`` rounds of ``--calls``
calls, microseconds per call, kernels alternating; the outputs are compared (max abs difference).

Usage: ``python bench/cpu_attention.py [--repeats 5] [--calls 10] [--threads 1]``; the last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rlhf.rollout import cpu_attention  # noqa: E402

# (slots, kv heads, G, D, columns, prompt columns read from the group's lead, group size)
SHAPES = [
    (128, 2, 2, 32, 56, 24, 8),
    (16, 2, 6, 64, 24, 0, 1),
    (16, 2, 7, 64, 512, 0, 1),
    (16, 2, 7, 64, 2048, 0, 1),
    (64, 2, 7, 64, 512, 0, 1),
    (128, 2, 7, 64, 300, 256, 8),
    (128, 2, 2, 32, 1100, 1024, 8),
    (8, 8, 4, 128, 1024, 0, 1),
]


def best_us(fn, repeats: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def case(b: int, h: int, g: int, d: int, t: int, pm: int, n: int, repeats: int, calls: int) -> dict:
    gen = torch.Generator().manual_seed(b * t + d)
    kv = torch.randn(2, b, h, t, d, generator=gen)
    lead = torch.arange(b) // n * n
    kv[:, :, :, :pm] = kv[:, lead, :, :pm]  # the samples of a group hold the same prompt columns
    q = torch.randn(b, h, g, d, generator=gen)
    first, last = torch.zeros(b, dtype=torch.int64), torch.full((b,), t - 1)
    scale = d ** -0.5
    k3, v3, mask = kv[0].reshape(b * h, t, d), kv[1].reshape(b * h, t, d), torch.zeros(b * h, 1, t)

    def fused() -> torch.Tensor:
        return cpu_attention.region_decode_attention(q, kv[0], kv[1], lead, first, last, pm, scale)

    def torch_ops() -> torch.Tensor:
        scores = torch.baddbmm(mask, q.reshape(b * h, g, d), k3.transpose(1, 2), alpha=scale)
        return torch.bmm(torch.softmax(scores, -1, dtype=torch.float32), v3).view(b, h, g, d)

    diff = float((fused() - torch_ops()).abs().max())
    f_us, t_us = best_us(fused, repeats, calls), best_us(torch_ops, repeats, calls)
    return {"slots": b, "kv_heads": h, "G": g, "D": d, "columns": t, "lead_prompt": pm, "n": n,
            "fused_us": round(f_us, 1), "torch_us": round(t_us, 1), "speedup": round(t_us / f_us, 2),
            "max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        sys.exit(f"bench/cpu_attention.py: the kernel is unavailable ({cpu_attention.unavailable_reason()})")
    rows = []
    for shape in SHAPES:
        r = case(*shape, args.repeats, args.calls)
        rows.append(r)
        print(f"{r['slots']:4d} slots x {r['kv_heads']} kv heads, G {r['G']}, D {r['D']:3d}, {r['columns']:5d} columns, "
              f"lead prompt {r['lead_prompt']:4d}: fused {r['fused_us']:8.1f} us  torch ops {r['torch_us']:8.1f} us  "
              f"{r['speedup']:5.2f}x  max|diff| {r['max_abs_diff']:.1e}", flush=True)
    print(json.dumps({"bench": "cpu_attention", "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
