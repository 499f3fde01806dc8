"""Benchmark: the built-in rollout sampler vs HF ``model.generate``, in one run.

Both run the same model weights (fp32, random init from a real architecture config), the
same prompts, the same ``max_new_tokens`` and the same sampling settings, HF with
``use_cache=True`` and left-padded batches. Figures are generated tokens per second
(tokens up to and including the stop token; padding after a finished sequence does not
count), median of ``--repeats`` runs, ours and HF alternating; ``ratio_best`` compares the
fastest run of each (the least disturbed by other processes on a shared machine).

Cases, for batch sizes 1, 16, 64, 256 (``--quick``: 1, 16, 64):

* ``equal``: sampling at temperature 1 (top-k / top-p off), no stop token: every sequence
  generates exactly ``max_new_tokens``.
* ``uneven``: greedy decoding with a stop token chosen so that response lengths are very
  uneven. How: our sampler first decodes the prompts greedily without a stop; the stop id
  is the token whose first occurrences give the shortest mean length while at least one
  response still runs to ``max_new_tokens`` (``len/max`` in the output). Greedy is
  deterministic and matches HF in fp32, so HF stops at the same positions
  (``lengths_match`` reports the fraction of equal lengths). HF keeps computing finished
  rows until the longest one ends; our sampler retires them.
* ``grpo``: 16 prompts x n=8 samples, temperature 1 (HF: ``num_return_sequences=8``); our
  sampler prefills each prompt once for its 8 samples.

Usage: ``python bench/sampler.py [--model tiny|100m|qwen2.5-0.5b|all] [--quick] [--repeats 3] [--threads N]``;
on a GPU: ``--device cuda [--dtype bfloat16] [--compile] [--batches 1,64,256]`` (bf16 by default),
which adds the share of the HBM-bandwidth roofline (weights read once per decode step).
(threads default to 1, see ``--help``).
The last printed line is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rlhf.ops.flops import matmul_params  # noqa: E402
from rlhf.ops.hardware import device_description, hbm_bandwidth, peak_flops  # noqa: E402
from rlhf.rollout import Sampler, SamplingParams  # noqa: E402

PAD = 0
MODELS = {
    # the quickstart's size: Qwen2 architecture, 4 layers, hidden 128, vocab 64
    "tiny": dict(vocab_size=64, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1),
    # ~100M parameters: Qwen2-0.5B-like shape scaled down (tied embeddings, GQA 12/2)
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen2.5-0.5B's architecture exactly (random weights): the GPU check's model
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
}
SETTINGS = {  # prompt length range, max_new_tokens (full, quick)
    "tiny": ((8, 24), 64, 32),
    "100m": ((8, 16), 16, 8),
    "qwen2.5-0.5b": ((16, 64), 128, 64),
}


def build(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**MODELS[name])
    model = transformers.Qwen2ForCausalLM(cfg).to(device, dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def make_prompts(num: int, lens: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        n = int(torch.randint(lens[0], lens[1] + 1, (1,), generator=g))
        out.append(torch.randint(1, vocab, (n,), generator=g).tolist())
    return out


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_lengths(new_tokens: torch.Tensor, stop: int | None) -> torch.Tensor:
    """Response lengths of HF output ``[N, R]``: up to and including the first stop token."""
    r = new_tokens.shape[1]
    if stop is None:
        return torch.full((new_tokens.shape[0],), r)
    hit = new_tokens == stop
    first = torch.where(hit.any(1), hit.float().argmax(1), torch.full((new_tokens.shape[0],), r - 1))
    return first + 1


def choose_stop(sampler: Sampler, prompts: list[list[int]], max_new: int) -> tuple[int, list[int]]:
    """Stop token that makes greedy response lengths most uneven.

    Among tokens that leave at least one response running to ``max_new_tokens`` (so a
    padded batch still needs every step), pick the one with the shortest mean length.
    """
    out = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    ids = out.response_ids.cpu()
    best, best_mean, best_lens = None, float("inf"), []
    for v in ids.unique().tolist():
        lens = hf_lengths(ids, v)
        if int(lens.max()) == max_new and float(lens.float().mean()) < best_mean:
            best, best_mean, best_lens = v, float(lens.float().mean()), lens.tolist()
    if best is None:  # every token ends all responses early: take the latest-ending one
        best = max(ids.unique().tolist(), key=lambda v: float(hf_lengths(ids, v).float().mean()))
        best_lens = hf_lengths(ids, best).tolist()
    return best, best_lens


def sync(device) -> None:
    """Wait for queued GPU work so that wall-clock times cover it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_case(model, sampler, prompts, case: str, max_new: int, repeats: int, clock=time.perf_counter) -> dict:
    n = 8 if case == "grpo" else 1
    stop = None
    if case == "uneven":
        stop, _ = choose_stop(sampler, prompts, max_new)
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=[stop])
        hf_kw = dict(do_sample=False)
    else:
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=1)
        hf_kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n)
    ids, mask = (t.to(model.device) for t in left_pad(prompts))
    ours_t, hf_t, ours_tok, hf_tok, stats = [], [], 0, 0, {}
    match = None
    for _ in range(repeats):
        sync(model.device)
        t = clock()
        out = sampler.generate(prompts, params)
        sync(model.device)
        ours_t.append(clock() - t)
        ours_tok = int(out.response_lengths.sum())
        stats = out.stats
        t = clock()
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, use_cache=True,
                                 pad_token_id=PAD, eos_token_id=stop, **hf_kw)
        sync(model.device)
        hf_t.append(clock() - t)
        lens = hf_lengths(gen[:, ids.shape[1]:].cpu(), stop)
        hf_tok = int(lens.sum())
        match = float((lens == out.response_lengths.cpu()).float().mean())
    ours_s, hf_s = statistics.median(ours_t), statistics.median(hf_t)
    return {
        "case": case, "batch": len(prompts) * n, "prompts": len(prompts), "n": n, "max_new_tokens": max_new,
        "ours_tok_s": ours_tok / ours_s, "hf_tok_s": hf_tok / hf_s, "ratio": (ours_tok / ours_s) / (hf_tok / hf_s),
        # best of the repeats: the cost with the least interference from other processes
        "ratio_best": (ours_tok / min(ours_t)) / (hf_tok / min(hf_t)),
        "ours_tokens": ours_tok, "hf_tokens": hf_tok, "ours_s": ours_s, "hf_s": hf_s,
        "lengths_match": match, "stop_id": stop,
        "mean_len_frac": ours_tok / (len(prompts) * n * max_new),
        "slot_utilisation": stats.get("slot_utilisation"), "decode_steps": stats.get("decode_steps"),
        "prefill_s": stats.get("prefill_s"), "decode_s": stats.get("decode_s"),
    }


def flops_per_token(model: torch.nn.Module) -> tuple[float, float]:
    """(body, head): matmul FLOPs per token in the decoder blocks and in the LM head
    (``rlhf.ops.flops.matmul_params``). A prompt token costs ``body`` (prefill computes logits
    only at the last position), a generated token ``body + head``. Attention over the short
    contexts here is left out, so the shares below slightly under-count."""
    n = matmul_params(model.config)
    return 2.0 * n["layers"], 2.0 * n["lm_head"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "100m", "qwen2.5-0.5b", "all"], default="all",
                    help="all = tiny and 100m (the CPU set)")
    ap.add_argument("--quick", action="store_true", help="batch sizes 1/16/64, fewer new tokens")
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (overrides the default set)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--compile", action="store_true", help="CUDA-graph decode (rollout.compile) for our sampler")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both engines (0: torch's default). Default 1: on a small shared "
                         "machine multi-threaded timings are dominated by OpenMP barrier stalls whenever "
                         "another process holds a core")
    ap.add_argument("--cases", default="equal,uneven,grpo")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (CPU device, 1 thread), which other processes' load on a "
                         "shared machine does not inflate the way it inflates wall-clock time")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/sampler.py: --device cuda but no CUDA device is visible")
    if args.clock == "cpu" and (device.type != "cpu" or args.threads != 1):
        sys.exit("bench/sampler.py: --clock cpu measures a 1-thread CPU run (--device cpu --threads 1)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [1, 16, 64] if args.quick else [1, 16, 64, 256]
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    cases = args.cases.split(",")
    result: dict = {"bench": "sampler", "threads": torch.get_num_threads(), "machine": platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                    "device": device_description(device), "dtype": str(dtype).removeprefix("torch."),
                    "compile": args.compile, "quick": args.quick, "repeats": args.repeats, "clock": args.clock,
                    "models": {}}
    # compute roof: the datasheet on a GPU, a measured matmul on CPU; memory roof on GPU only
    peak = peak_flops(device, dtype)
    hbm = hbm_bandwidth(device)
    result["matmul_peak_gflops"] = peak / 1e9 if peak else None
    result["hbm_gb_s"] = hbm / 1e9 if hbm else None
    names = ["tiny", "100m"] if args.model == "all" else [args.model]
    for name in names:
        model = build(name, args.device, dtype)
        lens, full_new, quick_new = SETTINGS[name]
        max_new = quick_new if args.quick else full_new
        t = time.perf_counter()
        sampler = Sampler(model.config, model.state_dict(), pad_token_id=PAD, max_num_seqs=256, device=device,
                          use_cuda_graph=args.compile)
        setup_s = time.perf_counter() - t
        warm = make_prompts(4, lens, model.config.vocab_size, seed=99)
        sampler.generate(warm, SamplingParams(max_new_tokens=4))
        with torch.no_grad():
            model.generate(left_pad(warm)[0].to(device), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
        rows = []
        for case in cases:
            for b in ([16] if case == "grpo" else batches):
                prompts = make_prompts(b, lens, model.config.vocab_size, seed=b)
                row = run_case(model, sampler, prompts, case, max_new, args.repeats, clock)
                # Share of the compute roof each engine reaches: useful work = every prompt
                # token once + every generated token.
                body, head = flops_per_token(model)
                useful = sum(len(p) for p in prompts) * body + row["ours_tokens"] * (body + head)
                row["ours_frac_of_peak"] = useful / row["ours_s"] / peak if peak else None
                row["hf_frac_of_peak"] = useful / row["hf_s"] / peak if peak else None
                # Share of the HBM roofline: each decode step must read every weight once
                # (KV reads left out, so this under-counts a little); the binding roof at batch 1.
                steps = row["decode_steps"] or max_new
                row["ours_frac_of_hbm"] = steps * weight_bytes / row["ours_s"] / hbm if hbm else None
                row["hf_frac_of_hbm"] = max_new * weight_bytes / row["hf_s"] / hbm if hbm else None
                rows.append(row)
                roof = f"  hbm share ours {row['ours_frac_of_hbm']:.2f}" if hbm else ""
                print(f"{name:5s} {case:7s} batch {row['batch']:4d}: ours {row['ours_tok_s']:9.1f} tok/s  "
                      f"hf {row['hf_tok_s']:9.1f} tok/s  ratio {row['ratio']:5.2f} (best {row['ratio_best']:5.2f})  "
                      f"len/max {row['mean_len_frac']:.2f}  lengths_match {row['lengths_match']:.2f}  "
                      f"peak share ours {row['ours_frac_of_peak'] or 0:.3f} hf {row['hf_frac_of_peak'] or 0:.3f}"
                      + roof, flush=True)
        params = sum(p.numel() for p in model.parameters())
        big = [r["ratio"] for r in rows if r["batch"] >= 16]
        result["models"][name] = {"params": params, "sampler_setup_s": setup_s, "cases": rows,
                                  "min_ratio_batch_ge_16": min(big) if big else None,
                                  "median_ratio_batch_ge_16": statistics.median(big) if big else None}
        del model, sampler
    print(json.dumps(result))


if __name__ == "__main__":
    main()
