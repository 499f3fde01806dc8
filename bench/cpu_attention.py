"""Benchmark: the fused CPU decode-attention kernel (``rlhf.rollout.cpu_attention``) vs the torch ops it
replaces (the gather kernel's ``baddbmm`` + fp32 softmax + ``bmm`` over the (slot, kv head) pairs), one
layer's call, in one run.

Shapes: the tiny GRPO step of ``bench/sampler.py`` (128 slots, G = 2, D = 32, a 24-column prompt read from
each group's lead), the 100M model's and Qwen2.5-0.5B's heads (G = 6-7, D = 64) at 24-2048 columns, long
shared prompts (256 and 1024 columns, n = 8) and D = 128. Random fp32 slot regions; every slot sees all its
columns; hot caches (the same regions every call). Figures: best of ``--repeats`` rounds of ``--calls``
calls, microseconds per call, kernels alternating; the outputs are compared (max abs difference).

``--sampler``: also whole ``generate`` calls of the tiny model of ``bench/sampler.py`` with the kernel on and
off (the torch ops), alternating, CPU time, same tokens asserted: GRPO (16 prompts x 8, aligned slot regions),
the same with tool turns (a deterministic fake tool answers a call token with 1-3 tokens, at most 2 turns per
sample: the paged cache with parked sequences) and under a KV budget (``kv_cache_tokens`` = 2048: paged,
preempting).

Usage: ``python bench/cpu_attention.py [--repeats 5] [--calls 10] [--threads 1] [--sampler]``; the last line
is one JSON object.
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


class _Tool:
    """After ``call`` (at most 2 turns per row) the row gets the observation ``[60 + (row + turn) % 4] * k``,
    ``k = 1 + (row + turn) % 3``, at once (the sampler's multi-turn protocol, as tests/unit/test_sampler_turns)."""

    def __init__(self, call: int) -> None:
        self.call, self.turns, self.pending = call, {}, {}

    def turn_ended(self, row: int, response: list[int]) -> bool:
        if response[-1] != self.call or self.turns.get(row, 0) >= 2:
            return False
        t = self.turns[row] = self.turns.get(row, 0) + 1
        self.pending[row] = [60 + (row + t) % 4] * (1 + (row + t) % 3)
        return True

    def poll(self, wait: bool) -> list[tuple[int, list[int]]]:
        out, self.pending = list(self.pending.items()), {}
        return out


def sampler_rows(repeats: int) -> list[dict]:
    from sampler import PAD, build, make_prompts  # bench/sampler.py
    from rlhf.rollout import Sampler, SamplingParams

    model = build("tiny")
    prompts = make_prompts(16, (8, 24), model.config.vocab_size, seed=16)
    rows = []
    for name, kw, turns, stop in (("grpo", {}, False, []), ("grpo + tool turns", {}, True, [7]),
                                  ("grpo, KV budget 2048", {"kv_cache_tokens": 2048}, False, [])):
        params = SamplingParams(n=8, temperature=1.0, max_new_tokens=48, seed=1, stop_token_ids=stop)
        samplers = {}
        for on in (True, False):
            samplers[on] = Sampler(model.config, model.state_dict(), pad_token_id=PAD, max_num_seqs=256, **kw)
            samplers[on].decode_attention.base.fused = on
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for r in range(repeats + 1):
            for on, s in samplers.items():
                t = time.process_time()
                outs[on] = s.generate(prompts, params, turns=_Tool(7) if turns else None)
                if r:
                    times[on].append(time.process_time() - t)
        assert torch.equal(outs[True].response_ids, outs[False].response_ids), name
        on_ms, off_ms = (statistics.median(times[k]) * 1e3 for k in (True, False))
        cache = samplers[True].cache
        rows.append({"case": name, "layout": "aligned regions" if cache.prefix_cols else
                     ("regions" if cache.contiguous else "paged"), "turns": int(outs[True].stats.get("turns", 0)),
                     "preemptions": int(outs[True].stats.get("preemptions", 0)), "on_ms": round(on_ms, 1),
                     "off_ms": round(off_ms, 1), "speedup": round(off_ms / on_ms, 2),
                     "max_logprob_diff": float((outs[True].log_probs - outs[False].log_probs).abs().max())})
        print(f"generate {name:22s} ({rows[-1]['layout']}, turns {rows[-1]['turns']}, preemptions "
              f"{rows[-1]['preemptions']}): kernel on {on_ms:7.1f} ms  off {off_ms:7.1f} ms  {off_ms / on_ms:5.2f}x",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sampler", action="store_true", help="also whole generate calls, kernel on vs off")
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
    generate = sampler_rows(args.repeats) if args.sampler else []
    print(json.dumps({"bench": "cpu_attention", "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows, "generate": generate}))


if __name__ == "__main__":
    main()
