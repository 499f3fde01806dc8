"""Benchmark: ``torch.compile`` (inductor, CPU) of the sampler's decode step vs eager, in one run.

The decode forward (``rlhf.models.decoder.decode``) of bench/sampler.py's tiny model, at fixed
shapes (``dynamic=False``: one compile per (batch, window) bucket, as a CUDA graph is per bucket),
on a sampler that has just run a GRPO-sized generate (slot-region cache). Two variants:

* ``whole``: the step as it is, cache writes included (inductor functionalises the in-place write into
  the cache and copies the whole cache buffer back);
* ``no_cache_ops``: the cache's write / plan / attention left eager (``torch.compiler.disable``), the
  projections, norms, rope and MLP compiled.

Figures: compile seconds (wall, first call), CPU microseconds per step (median of rounds,
eager and compiled alternating, 1 thread) and the largest logit difference to eager.

Usage: ``python bench/decode_compile.py [--batches 16,128] [--window 50] [--variant both]``; last line JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sampler as bench_sampler  # noqa: E402
from rlhf.models import decoder  # noqa: E402
from rlhf.rollout import Sampler, SamplingParams  # noqa: E402


def per_step_us(fn, rounds: int = 5, n: int = 30) -> list[float]:
    out = []
    for _ in range(rounds):
        fn()
        t = time.process_time()
        for _ in range(n):
            fn()
        out.append((time.process_time() - t) / n * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="16,128")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--variant", choices=["whole", "no_cache_ops", "both"], default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = bench_sampler.build("tiny")
    rows = []
    for variant in (["whole", "no_cache_ops"] if args.variant == "both" else [args.variant]):
        for b in [int(x) for x in args.batches.split(",")]:
            torch._dynamo.reset()
            s = Sampler(model.config, model.state_dict(), pad_token_id=0, max_num_seqs=256, cascade_attention=False)
            s.generate(bench_sampler.make_prompts(16, (8, 24), 64, seed=16), SamplingParams(n=8, max_new_tokens=32))
            s.pos_buf[:b] = torch.randint(args.window - 30, args.window - 1, (b,))
            c = s.cache
            if variant == "no_cache_ops":
                for name in ("write", "attend", "decode_plan", "decode_index"):
                    setattr(c, name, torch.compiler.disable(getattr(c, name)))
            fwd = (s.spec, s.weights, c, s.token_buf[:b], s.pos_buf[:b], args.window, s.cos, s.sin)
            compiled = torch.compile(decoder.decode, dynamic=False)
            with torch.inference_mode():
                ref = decoder.decode(*fwd)
                t = time.perf_counter()
                diff = float((compiled(*fwd) - ref).abs().max())
                compile_s = time.perf_counter() - t
                eager_us, comp_us = [], []
                for _ in range(3):
                    eager_us += per_step_us(lambda: decoder.decode(*fwd), rounds=2)
                    comp_us += per_step_us(lambda: compiled(*fwd), rounds=2)
            row = {"variant": variant, "batch": b, "window": args.window, "compile_s": compile_s,
                   "eager_us": statistics.median(eager_us), "compiled_us": statistics.median(comp_us),
                   "max_logit_diff": diff}
            row["speedup"] = row["eager_us"] / row["compiled_us"]
            rows.append(row)
            print(f"{variant:12s} batch {b:4d}: compile {compile_s:5.1f} s  eager {row['eager_us']:7.0f} us  "
                  f"compiled {row['compiled_us']:7.0f} us  speedup {row['speedup']:.2f}  max |dlogit| {diff:.1e}",
                  flush=True)
    print(json.dumps({"bench": "decode_compile", "load_avg": os.getloadavg(), "rows": rows}))


if __name__ == "__main__":
    main()
