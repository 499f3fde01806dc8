"""Benchmark: the generic rollout path vs the fast functional decoder, same model, one run.

One tiny Qwen2 (random fp32 weights; ``--hidden``, ``--layers``), the same prompts and sampling on both
paths of ``rlhf.rollout.sampler.Sampler``: the fast path (``rlhf.models.decoder``) and the generic path
(``generic_path=True``: the HF module's own forward with paged attention through ``AttentionInterface``,
``rlhf.rollout.generic``). Both generate the same tokens (checked); the figure is generated tokens per
second, median of ``--repeats`` alternating runs, and ``slowdown`` = fast / generic. The start-up line of a
generic model quotes this slowdown (``rlhf.models.generic.GENERIC_SLOWDOWN``).

Usage: ``python bench/generic_path.py [--batch 16] [--new 64] [--repeats 3] [--threads 1] [--device cpu]``.
The last printed line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers

from rlhf.rollout.sampler import Sampler
from rlhf.rollout.sampling import SamplingParams


def model(hidden: int, layers: int) -> tuple[transformers.PretrainedConfig, dict]:
    config = transformers.Qwen2Config(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 3,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    return config, {k: v.clone() for k, v in m.state_dict().items()}


def run(config, weights, generic: bool, prompts, params, device) -> tuple[float, torch.Tensor]:
    s = Sampler(config, dict(weights), pad_token_id=0, device=device, dtype=torch.float32,
                max_num_seqs=len(prompts) * params.n, generic_path=generic)
    s.generate(prompts[:1], params)  # warm-up (allocation, first-call overheads)
    t0 = time.perf_counter()
    out = s.generate(prompts, params)
    dt = time.perf_counter() - t0
    return float(out.response_lengths.sum()) / dt, out.response_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    config, weights = model(a.hidden, a.layers)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1024, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=a.new, stop_token_ids=[], seed=0)
    fast, generic = [], []
    for _ in range(a.repeats):
        f, ids_f = run(config, weights, False, prompts, params, a.device)
        gen, ids_g = run(config, weights, True, prompts, params, a.device)
        assert torch.equal(ids_f, ids_g), "the two paths sampled different tokens"
        fast.append(f)
        generic.append(gen)
    res = {"model": f"qwen2 hidden={a.hidden} layers={a.layers}", "batch": a.batch, "prompt": a.prompt,
           "new_tokens": a.new, "device": a.device, "threads": a.threads,
           "fast_tokens_per_s": statistics.median(fast), "generic_tokens_per_s": statistics.median(generic),
           "loadavg": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None}
    res["slowdown"] = res["fast_tokens_per_s"] / res["generic_tokens_per_s"]
    print(f"fast path    {res['fast_tokens_per_s']:9.1f} tok/s")
    print(f"generic path {res['generic_tokens_per_s']:9.1f} tok/s   ({res['slowdown']:.2f}x slower)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
