"""Benchmark: the sampler's per-step dispatch cuts on vs off, in one run (issue 38 item 4).

"On" is the default sampler: eager decode forwards and sampling under ``torch.inference_mode``
(``Sampler.inference_mode``) and, on CPU, inverse-CDF sampling without the GPU-scan guard
(``rlhf.rollout.sampling.inverse_cdf``). "Off" is ``no_grad`` only and the guard forced on through
the ``sampling._cumsum`` seam (what the sampler did before). Same sampler, same weights and
prompts (``bench/sampler.py``'s tiny model and cases), the two settings alternating, ``--repeats``
runs each; figures are this process's CPU time per ``generate`` (1 thread), which other processes'
load inflates less than wall time, and aten calls per decode step (``torch.profiler``).
Tokens must be identical on and off (asserted), log-probs equal to 1e-6.

Usage: ``python bench/decode_dispatch.py [--model tiny] [--repeats 7]``; last line JSON.
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
import sampler as bench_sampler  # noqa: E402  (bench/sampler.py: models, prompts)
from rlhf.rollout import Sampler, SamplingParams, sampling  # noqa: E402

CASES = [("equal", 1, 1), ("equal", 16, 1), ("equal", 64, 1), ("grpo", 16, 8)]


def setting(s: Sampler, on: bool) -> None:
    s.inference_mode = on
    sampling._cumsum = torch.cumsum if on else (lambda p, dim: torch.cumsum(p, dim))  # guard runs when off


def aten_calls_per_step(s: Sampler, prompts: list, params: SamplingParams) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = s.generate(prompts, params)
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return calls / out.stats["decode_steps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = bench_sampler.build(args.model)
    s = Sampler(model.config, model.state_dict(), pad_token_id=0, max_num_seqs=256)
    lens = bench_sampler.SETTINGS[args.model][0]
    rows = []
    for case, prompts_n, n in CASES:
        prompts = bench_sampler.make_prompts(prompts_n, lens, model.config.vocab_size, seed=prompts_n)
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1)
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for _ in range(args.repeats):
            for on in (False, True):
                setting(s, on)
                t = time.process_time()
                outs[on] = s.generate(prompts, params)
                times[on].append(time.process_time() - t)
        assert torch.equal(outs[True].response_ids, outs[False].response_ids), "tokens differ on vs off"
        dlp = float((outs[True].log_probs - outs[False].log_probs).abs().max())
        calls = {}
        for on in (False, True):
            setting(s, on)
            calls[on] = aten_calls_per_step(s, prompts, params)
        off, on_ = statistics.median(times[False]), statistics.median(times[True])
        row = {"case": case, "batch": prompts_n * n, "off_s": off, "on_s": on_, "speedup": off / on_,
               "speedup_best": min(times[False]) / min(times[True]), "aten_calls_per_step_off": calls[False],
               "aten_calls_per_step_on": calls[True], "max_logprob_diff": dlp}
        rows.append(row)
        print(f"{case:6s} batch {row['batch']:4d}: off {off * 1e3:7.1f} ms  on {on_ * 1e3:7.1f} ms  "
              f"speedup {row['speedup']:.3f} (best {row['speedup_best']:.3f})  aten calls/step "
              f"{calls[False]:.0f} -> {calls[True]:.0f}  max |dlogp| {dlp:.1e}", flush=True)
    setting(s, True)
    print(json.dumps({"bench": "decode_dispatch", "model": args.model, "load_avg": os.getloadavg(), "cases": rows}))


if __name__ == "__main__":
    main()
