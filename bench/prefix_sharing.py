"""Prefix sharing in the paged KV cache: peak KV blocks and tokens/s of a GRPO batch (16 prompts
x n = 8), the n samples sharing their prompt's full blocks vs each holding a copy, in one run.

    python bench/prefix_sharing.py                 # ~1 min on a 2-core CPU
    python bench/prefix_sharing.py --clock cpu     # CPU time: steadier on a loaded machine

Cases (tiny model of ``bench/sampler.py``, temperature 1, ``--new`` tokens, no stop, blocks of 16):

* ``random``: prompt lengths drawn in ``--prompt-lens``; each sample's partial last prompt block is
  its own (decoding writes there), so the saving is (n - 1) x the full prompt blocks.
* ``aligned``: prompt lengths multiples of the block size, so every prompt block is shared.
* ``budget``: the random prompts under a KV budget of ``--budget`` x the unshared peak: with
  sharing fewer sequences are preempted and recomputed, which is where the saving buys speed.

``prompt blocks`` = blocks the prompts take without sharing (n x sum of ceil(len / 16));
``target`` = (n - 1) / n of that; ``saved`` = unshared peak - shared peak (the cache is paged,
``slot_regions=False``, so both runs admit every sequence at once). Tokens and log-probs of the
two runs are compared (they must be equal). The last line is one JSON object.
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
from bench.sampler import PAD, build, make_prompts  # noqa: E402
from rlhf.rollout import Sampler, SamplingParams  # noqa: E402

BS = 16


def run(model, prompts, params, repeats: int, clock, **kw) -> dict:
    """Sharing off / on, alternating, ``repeats`` times each: peak blocks, tokens/s, equality."""
    out, times = {}, {False: [], True: []}
    for _ in range(repeats):
        for share in (False, True):
            s = Sampler(model.config, model.state_dict(), pad_token_id=PAD, max_num_seqs=256, block_size=BS,
                        slot_regions=False, prefix_sharing=share, **kw)
            t = clock()
            out[share] = s.generate(prompts, params)
            times[share].append(clock() - t)
    off, on = out[False], out[True]
    tokens = int(on.response_lengths.sum())
    n = params.n
    prompt_blocks = n * sum(-(-len(p) // BS) for p in prompts)
    peak_off, peak_on = off.stats["kv_peak_tokens"] / BS, on.stats["kv_peak_tokens"] / BS
    return {
        "prompt_blocks": prompt_blocks, "target_saved": (n - 1) / n * prompt_blocks,
        "peak_blocks_off": peak_off, "peak_blocks_on": peak_on, "saved": peak_off - peak_on,
        "saved_over_target": (peak_off - peak_on) / ((n - 1) / n * prompt_blocks),
        "tok_s_off": tokens / statistics.median(times[False]), "tok_s_on": tokens / statistics.median(times[True]),
        "preemptions_off": off.stats["preemptions"], "preemptions_on": on.stats["preemptions"],
        "same_tokens": bool(torch.equal(off.response_ids, on.response_ids)),
        "max_logprob_diff": float((off.log_probs - on.log_probs).abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-lens", default="64,192", help="min,max prompt length of the random case")
    ap.add_argument("--new", type=int, default=32, help="max_new_tokens")
    ap.add_argument("--budget", type=float, default=0.6, help="budget case: KV tokens as a share of the unshared peak")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = build("tiny")
    lo, hi = (int(x) for x in args.prompt_lens.split(","))
    random = make_prompts(args.prompts, (lo, hi), model.config.vocab_size, seed=0)
    aligned = [p[: max(BS, len(p) // BS * BS)] for p in random]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new, seed=1)
    result = {"bench": "prefix_sharing", "prompts": args.prompts, "n": args.n, "block_size": BS,
              "max_new_tokens": args.new, "clock": args.clock, "repeats": args.repeats, "cases": {}}
    for case, prompts, kw in (("random", random, {}), ("aligned", aligned, {}), ("budget", random, None)):
        if kw is None:
            peak = result["cases"]["random"]["peak_blocks_off"] * BS
            kw = {"kv_cache_tokens": int(args.budget * peak) // BS * BS}
        row = run(model, prompts, params, args.repeats, clock, **kw)
        row.update(kw)
        result["cases"][case] = row
        vs = (f"(target (n-1)/n x {row['prompt_blocks']} prompt blocks = {row['target_saved']:.0f}: "
              f"{row['saved_over_target']:.2f})" if case != "budget" else f"(budget {kw['kv_cache_tokens'] // BS} blocks)")
        print(f"{case:8s} peak blocks unshared {row['peak_blocks_off']:6.0f}  shared {row['peak_blocks_on']:6.0f}  "
              f"saved {row['saved']:5.0f} {vs}  tok/s unshared {row['tok_s_off']:7.1f} "
              f"shared {row['tok_s_on']:7.1f} ({row['tok_s_on'] / row['tok_s_off']:.2f}x)  preemptions "
              f"{row['preemptions_off']:.0f} / {row['preemptions_on']:.0f}  same tokens {row['same_tokens']}",
              flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
