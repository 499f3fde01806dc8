"""GPT-OSS's sink attention in the trainer: the explicit form vs the sink as one more SDPA key, in one run.

    python bench/sink_attention.py [--lengths 512,1024,2048] [--heads 16] [--repeats 3]

Both run forward + backward of one packed bucket (1 row, GPT-OSS's head dim 64, 8 query heads per kv
head, fp32 on this CPU) through ``rlhf.models.softcap_attention``: ``attention`` (softmax over
``[scores, sink]``, what HF's eager GPT-OSS does) and ``sink_sdpa`` (the trainer's path since this
change). Printed per length: the outputs' and gradients' largest difference, the peak of live tensor
bytes during the call (``rlhf.ops.sim_memory.LiveBytes`` over real tensors), the median wall time, and
the ratios. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.models.softcap_attention import attention, sink_sdpa  # noqa: E402
from rlhf.ops.sim_memory import LiveBytes  # noqa: E402


def run(fn, q, k, v, sinks, mask) -> tuple[torch.Tensor, tuple, int, float]:
    counter = LiveBytes()
    t0 = time.perf_counter()
    with counter:
        counter.phase("call")
        out = fn(q, k, v, mask, scale=q.shape[-1] ** -0.5, sinks=sinks)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    return out.detach(), grads, counter.peaks["call"]["total"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for T in map(int, args.lengths.split(",")):
        H, D = args.heads, 64
        q = torch.randn(1, H, T, D, requires_grad=True)
        k, v = (torch.randn(1, H // 8, T, D, requires_grad=True) for _ in range(2))
        sinks = torch.randn(H, requires_grad=True)
        causal = torch.ones(T, T, dtype=torch.bool).tril()

        def explicit(q, k, v, mask, *, scale, sinks):
            return attention(q, k, v, causal, scale=scale, softcap=None, sinks=sinks)

        res = {}
        for name, fn in (("explicit", explicit), ("sink_sdpa", sink_sdpa)):
            runs = [run(fn, q, k, v, sinks, None) for _ in range(args.repeats)]
            res[name] = (runs[0][0], runs[0][1], runs[0][2], statistics.median(r[3] for r in runs))
        diff = max([(res["explicit"][0] - res["sink_sdpa"][0]).abs().max().item()]
                   + [(a - b).abs().max().item() for a, b in zip(res["explicit"][1], res["sink_sdpa"][1])])
        row = {"length": T, "heads": H, "max_abs_diff": diff,
               "explicit_peak_MiB": res["explicit"][2] / 2 ** 20, "sdpa_peak_MiB": res["sink_sdpa"][2] / 2 ** 20,
               "explicit_s": res["explicit"][3], "sdpa_s": res["sink_sdpa"][3]}
        row["memory_ratio"] = row["explicit_peak_MiB"] / row["sdpa_peak_MiB"]
        row["speedup"] = row["explicit_s"] / row["sdpa_s"]
        rows.append(row)
        print(f"T {T:5d}: max |diff| {diff:.2e}; peak {row['explicit_peak_MiB']:8.1f} -> {row['sdpa_peak_MiB']:7.1f} "
              f"MiB ({row['memory_ratio']:.1f}x less); {row['explicit_s'] * 1e3:8.1f} -> {row['sdpa_s'] * 1e3:7.1f} "
              f"ms ({row['speedup']:.2f}x)", flush=True)
    print(json.dumps({"bench": "sink_attention", "threads": torch.get_num_threads(),
                      "load": open("/proc/loadavg").read().split()[:3], "rows": rows}))


if __name__ == "__main__":
    main()
