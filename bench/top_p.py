"""Top-p sampling step: the full-vocabulary stable sort it used vs the top-k pre-filter (rlhf/rollout/sampling.py).

    python bench/top_p.py [--rows 64] [--vocab 151936] [--device cpu|cuda]

Two logit shapes: Zipf-like (a language model's usual next-token distribution: the nucleus holds
tens of tokens) and flat (the nucleus reaches past the pre-filter, so the sort runs after all).
Prints ms per call of ``top_p_nucleus`` with the pre-filter and with ``prefilter = vocab`` (the
sort), and whether the pre-filter held the nucleus.
"""

from __future__ import annotations

import argparse
import time

import torch

from rlhf.rollout.sampling import TOP_P_PREFILTER, top_p_nucleus


def _logits(kind: str, rows: int, vocab: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "flat":
        x = torch.randn(rows, vocab, generator=g) * 0.3
    else:  # log p ~ -3.3 log(rank) + noise, ranks shuffled per row
        rank = torch.rand(rows, vocab, generator=g).argsort(dim=-1).float() + 1
        x = -1.1 * rank.log() * 3 + 0.1 * torch.randn(rows, vocab, generator=g)
    return torch.log_softmax(x, -1).to(device)


def _time(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    for kind in ("zipf", "flat"):
        logp = _logits(kind, a.rows, a.vocab, a.device)
        fast = _time(lambda: top_p_nucleus(logp, a.top_p), a.device, a.reps)
        full = _time(lambda: top_p_nucleus(logp, a.top_p, prefilter=a.vocab), a.device, a.reps)
        held = top_p_nucleus(logp, a.top_p)[0].shape[1] < a.vocab
        print(f"{kind:5s} rows={a.rows} vocab={a.vocab} top_p={a.top_p} device={a.device}: pre-filter "
              f"({TOP_P_PREFILTER}) {fast:8.2f} ms  full sort {full:8.2f} ms  nucleus within the pre-filter: {held}")


if __name__ == "__main__":
    main()
