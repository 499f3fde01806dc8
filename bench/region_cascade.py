"""Benchmark: the aligned slot regions + shared-prompt decode attention of GRPO calls
(``rlhf.rollout.region_cascade``) on vs off, in one process.

Two samplers on the same weights (the tiny bench model of ``bench/sampler.py``); "off" keeps the
unaligned slot regions and the gather kernel (``decode_attention.aligns = False``). Cases: ``P`` prompts
x ``n`` samples (batch 128), temperature 1, prompts of 8-24 tokens (``bench/sampler.py``'s grpo case at
n = 8), and with a stop token (samples finish at different steps: groups gathered, not runs). Calls
alternate on / off; the figure is the median CPU time of a ``generate`` call (1 thread) and the speedup
off / on. Asserts identical tokens and lengths, log-probs within 1e-5 (fp32 rounding).

Usage: ``python bench/region_cascade.py [--repeats 7] [--new 32]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sampler import PAD, build, make_prompts  # noqa: E402  (bench/sampler.py)

from rlhf.rollout import Sampler, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--new", type=int, default=32, help="max_new_tokens")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build("tiny")
    samplers = {}
    for name in ("off", "on"):
        s = Sampler(model.config, model.state_dict(), pad_token_id=PAD, max_num_seqs=256)
        s.decode_attention.aligns = name == "on"
        samplers[name] = s
    rows = []
    for n, stop in ((8, None), (4, None), (2, None), (8, 7)):
        prompts = make_prompts(128 // n, (8, 24), model.config.vocab_size, seed=16)
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=args.new, seed=1,
                                stop_token_ids=[stop] if stop is not None else [])
        times: dict[str, list[float]] = {"off": [], "on": []}
        outs = {}
        for r in range(args.repeats + 1):
            for name, s in samplers.items():
                t = time.process_time()
                outs[name] = s.generate(prompts, params)
                if r:  # the first round warms up
                    times[name].append(time.process_time() - t)
        on, off = outs["on"], outs["off"]
        assert samplers["on"].cache.prefix_cols > 0 and samplers["off"].cache.prefix_cols == 0
        assert torch.equal(on.response_ids, off.response_ids), "tokens differ with the region cascade"
        assert torch.equal(on.response_lengths, off.response_lengths)
        diff = float((on.log_probs - off.log_probs).abs().max())
        assert diff <= 1e-5, f"log-probs differ by {diff}"
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"prompts": len(prompts), "n": n, "stop": stop, "mean_len": float(on.response_lengths.float().mean()),
               "off_ms": med["off"] * 1e3, "on_ms": med["on"] * 1e3, "speedup": med["off"] / med["on"],
               "speedup_best": min(times["off"]) / min(times["on"]), "logp_max_diff": diff}
        rows.append(row)
        print(f"{len(prompts):3d} x {n}  stop {stop!s:4s}  mean len {row['mean_len']:5.1f}  "
              f"off {row['off_ms']:7.1f} ms  on {row['on_ms']:7.1f} ms  "
              f"speedup {row['speedup']:.3f} (best {row['speedup_best']:.3f})  logp diff {diff:.1e}", flush=True)
    print(json.dumps({"bench": "region_cascade", "load": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
