"""Decode attention time per step: shared-prefix (cascade) kernel vs today's kernels, in one run.

    python bench/cascade_attention.py                  # CPU, --clock cpu (1 thread) by default
    python bench/cascade_attention.py --quick          # prompts 256 and 2048 only
    python bench/cascade_attention.py --device cuda --dtype bfloat16 --clock wall   # a GPU (synchronised)

A GRPO batch of ``--prompts`` prompts x n samples decodes with the prompt's K/V shared by the n
samples (full blocks of 16 positions, ``PagedKVCache.share``) and each sample's own response so
far (uniform in ``[0, --response)`` positions, i.e. mid-response on average). One decode step's
attention = the kernel's per-step plan + ``--layers`` calls of its ``attend`` (attention shapes of
the 100M model of bench/sampler.py: 12 query heads, 2 kv heads, head dim 64; fp32, or ``--dtype``). Kernels:

* ``regions``: today's CPU default when the budget holds every slot (slot regions read in place);
* ``gather``: today's paged kernel (each slot's window copied per layer, prompt blocks n times);
* ``cascade``: ``rlhf.rollout.cascade_attention`` on the shared blocks (the paged cache);
* ``fused``: the fused CPU kernel (``rlhf.rollout.cpu_attention``) on the slot regions aligned as a GRPO
  call aligns them (each sample reads its group's prompt from the group's first slot), CPU fp32 only;
* ``fused_paged``: the same kernel on the paged cache, through each slot's block table (the shared
  prompt blocks read by every member).

Each kernel's output is checked against ``gather`` (max abs difference printed). Figures are the
median over ``--repeats`` steps, kernels interleaved.

``--sampler``: also whole ``generate`` calls of the tiny model of bench/sampler.py (4 prompts of
``--sampler-prompts`` tokens (1024) x n, ``--new`` tokens, temperature 1): off (slot regions), paged
(the cascade on shared blocks, torch ops) and the sampler's default (on CPU fp32 with the fused kernel:
the aligned slot regions through it): generated tokens per CPU second, and whether tokens and log-probs
agree.
The last line is one JSON object.
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
from rlhf.models.arch import LayerAttn  # noqa: E402
from rlhf.rollout import cpu_attention  # noqa: E402
from rlhf.rollout.cascade_attention import CascadeAttention  # noqa: E402
from rlhf.rollout.kv_cache import PagedKVCache  # noqa: E402
from rlhf.rollout.paged_attention import GatherAttention  # noqa: E402

BS, HQ, HKV, D = 16, 12, 2, 64


def caches(prompts: int, n: int, plen: int, resp: int, seed: int, device: str = "cpu",
           dtype: torch.dtype = torch.float32) -> tuple[PagedKVCache, PagedKVCache, torch.Tensor]:
    """A paged cache with each prompt's full blocks shared by its n samples, the same K/V in a
    contiguous (slot regions) cache, aligned with the samples of a prompt in one group (every prompt
    has ``plen`` tokens: columns are positions), and the slots' current positions ``[B]``."""
    g = torch.Generator().manual_seed(seed)
    b, max_len = prompts * n, plen + resp
    pos = plen + torch.randint(0, resp, (b,), generator=g)
    kw = dict(block_size=BS, dtype=dtype, device=torch.device(device))
    paged = PagedKVCache(1, b * -(-max_len // BS), b, HKV, max_len, D, **kw)
    paged.start(contiguous=False)
    full = plen // BS
    for i in range(prompts):
        lead = i * n
        paged.grow([lead], [int(pos[lead]) + 1])
        paged.share(lead, list(range(lead + 1, lead + n)), full)
        paged.grow(list(range(lead + 1, lead + n)), [int(p) + 1 for p in pos[lead + 1: lead + n]])
    paged.kv.copy_(torch.randn(paged.kv.shape, generator=g))
    regions = PagedKVCache(1, b * -(-max_len // BS), b, HKV, max_len, D, **kw)
    regions.start(contiguous=True, prefix_cols=plen)
    regions.align(list(range(b)), [plen] * b, [i // n for i in range(b)])
    k, v = paged.view(0, torch.arange(b), max_len)  # [B, Hkv, T, D] each, read through the block table
    r = regions.regions()[0]  # [2, S, Hkv, T, D]
    r[0, :, :, :max_len], r[1, :, :, :max_len] = k, v
    return paged, regions, pos.to(device)


def step_time(kernel, cache, pos, q, layers: int, clock) -> tuple[float, torch.Tensor]:
    t = clock()
    plan = kernel.plan(cache, pos.shape[0], pos, int(pos.max()) + 1, q.dtype)
    for _ in range(layers):
        out = kernel.attend(cache, 0, q, plan, P)
    return clock() - t, out


P = LayerAttn(D ** -0.5, None, None, 0)


def sampler_case(n: int, plen: int, new: int, repeats: int, clock) -> dict:
    """Tokens per second of whole generate calls, alternating: ``off`` (slot regions, each sample reads its
    own prompt copy), ``paged`` (the cascade on shared prompt blocks, torch ops: the sampler's rule where the
    fused CPU kernel does not run) and ``default`` (the sampler's default: where the fused kernel runs, the
    aligned slot regions through it, each sample reading its group's prompt from the group's first slot);
    outputs compared with ``off``."""
    from bench.sampler import PAD, build, make_prompts
    from rlhf.rollout import Sampler, SamplingParams

    model = build("tiny")
    prompts = make_prompts(4, (plen, plen), model.config.vocab_size, seed=plen)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, seed=1)
    kw = dict(pad_token_id=PAD, max_num_seqs=256, prefill_tokens=max(8192, plen))
    samplers = {"off": Sampler(model.config, model.state_dict(), cascade_attention=False, **kw),
                "paged": Sampler(model.config, model.state_dict(), decode_attention=CascadeAttention(), **kw),
                "default": Sampler(model.config, model.state_dict(), **kw)}
    times: dict[str, list[float]] = {k: [] for k in samplers}
    outs = {}
    for _ in range(repeats):
        for name, s in samplers.items():
            t = clock()
            outs[name] = s.generate(prompts, params)
            times[name].append(clock() - t)
    assert not samplers["paged"].cache.contiguous
    tokens = float(outs["off"].response_lengths.sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"n": n, "prompt": plen, "new": new, "default_layout": "aligned regions" if samplers["default"].cache.prefix_cols
           else ("regions" if samplers["default"].cache.contiguous else "paged"),
           **{f"tok_s_{k}": round(tokens / v, 1) for k, v in med.items()},
           "paged_vs_off": round(med["off"] / med["paged"], 2), "default_vs_paged": round(med["paged"] / med["default"], 2)}
    for k in ("paged", "default"):
        row[f"same_tokens_{k}"] = bool(torch.equal(outs[k].response_ids, outs["off"].response_ids))
        row[f"max_logprob_diff_{k}"] = float((outs[k].log_probs - outs["off"].log_probs).abs().max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts (groups) in the batch")
    ap.add_argument("--ns", default="8,16")
    ap.add_argument("--prompt-lens", default="256,512,1024,2048")
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="prompts 256 and 2048, 3 repeats")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (then --clock wall, synchronised)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--sampler", action="store_true", help="also whole generate calls of the tiny model")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--sampler-prompts", default="1024", help="prompt lengths of the --sampler calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda":  # kernels launch asynchronously: a step ends when the GPU has finished it
        clock = lambda: (torch.cuda.synchronize(), time.perf_counter())[1]  # noqa: E731
    lens = [256, 2048] if args.quick else [int(x) for x in args.prompt_lens.split(",")]
    repeats = 3 if args.quick else args.repeats
    kernels = {"regions": GatherAttention(), "gather": GatherAttention(), "cascade": CascadeAttention()}
    if args.device == "cpu" and dtype == torch.float32 and cpu_attention.available():
        kernels["fused"] = CascadeAttention(GatherAttention(fused=True))
        kernels["fused_paged"] = GatherAttention(fused=True)
    rows = []
    for n in (int(x) for x in args.ns.split(",")):
        for plen in lens:
            paged, regions, pos = caches(args.prompts, n, plen, args.response, plen + n, args.device, dtype)
            q = torch.randn(pos.shape[0], HKV, HQ // HKV, D).to(args.device, dtype)
            times: dict[str, list[float]] = {k: [] for k in kernels}
            outs = {}
            for _ in range(repeats + 1):  # the first round warms the buffers up
                for name, kernel in kernels.items():
                    t, outs[name] = step_time(kernel, regions if name in ("regions", "fused") else paged, pos, q,
                                              args.layers, clock)
                    times[name].append(t)
            med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
            row = {"n": n, "prompt": plen, "slots": int(pos.shape[0]),
                   **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                   "vs_regions": round(med["regions"] / med["cascade"], 2),
                   "vs_gather": round(med["gather"] / med["cascade"], 2),
                   "max_abs_diff": float((outs["cascade"] - outs["gather"]).float().abs().max()),
                   "regions_diff": float((outs["regions"] - outs["gather"]).float().abs().max())}
            if "fused" in med:
                row.update(fused_vs_regions=round(med["regions"] / med["fused"], 2),
                           fused_vs_cascade=round(med["cascade"] / med["fused"], 2),
                           fused_diff=float((outs["fused"] - outs["gather"]).abs().max()),
                           fused_paged_vs_cascade=round(med["cascade"] / med["fused_paged"], 2),
                           fused_paged_diff=float((outs["fused_paged"] - outs["gather"]).abs().max()))
            rows.append(row)
            print(f"n={n:3d} prompt={plen:5d} slots={row['slots']:3d}  attention ms/step: regions {med['regions']:8.2f}"
                  f"  gather {med['gather']:8.2f}  cascade {med['cascade']:8.2f}  speed-up vs regions "
                  f"{row['vs_regions']:5.2f}x  vs gather {row['vs_gather']:5.2f}x  max|diff| {row['max_abs_diff']:.1e}"
                  + (f"  | fused {med['fused']:8.2f}  vs regions {row['fused_vs_regions']:5.2f}x  vs cascade "
                     f"{row['fused_vs_cascade']:5.2f}x  max|diff| {row['fused_diff']:.1e}  | fused paged "
                     f"{med['fused_paged']:8.2f}  vs cascade {row['fused_paged_vs_cascade']:5.2f}x  max|diff| "
                     f"{row['fused_paged_diff']:.1e}" if "fused" in med else ""),
                  flush=True)
            del paged, regions
    sampler_rows = []
    if args.sampler and args.device == "cpu":
        for n in (int(x) for x in args.ns.split(",")):
            for plen in args.sampler_prompts.split(","):
                r = sampler_case(n, int(plen), args.new, repeats, clock)
                sampler_rows.append(r)
                print(f"sampler tiny n={n} prompt {plen} new {args.new}: " + "  ".join(
                    f"{k}={v}" for k, v in r.items() if k not in ("n", "prompt", "new")), flush=True)
    print(json.dumps({"bench": "cascade_attention", "sampler": sampler_rows, "layers": args.layers, "prompts": args.prompts,
                      "response": args.response, "clock": args.clock, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                      "heads": [HQ, HKV, D], "block_size": BS, "rows": rows}))


if __name__ == "__main__":
    main()
