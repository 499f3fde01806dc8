"""One GRPO step's pieces at real shapes, against the hardware's limits, in one run of at most ~6 minutes on a GPU.

    python bench/gpu_step.py                            # H200: Qwen2.5-1.5B and Qwen2.5-7B, about 5-6 minutes
    python bench/gpu_step.py --models Qwen2.5-1.5B      # one shape
    python bench/gpu_step.py --device cpu --tiny        # the same code on a toy shape, < 30 s (CI runs it)

Shapes: ``configs/models/<name>/config.json`` unchanged, random bf16 weights (nothing is downloaded); a GRPO batch
of 32 prompts x 8 samples, prompts of 256 tokens, responses up to 1024 tokens with a long-tail mix (a random model
samples nearly uniformly, so ``k`` stop ids out of the vocabulary end a response with probability ``k / V`` per
token: geometric lengths with mean ``--mean-response``, the tail cut at 1024). ``--tiny``: a 2-layer model of the
1.5B config's family, 2 prompts x 4, prompts of 16, responses up to 24.

It prints, per model:

* decode tokens/s of our sampler (CUDA graphs on a GPU) and its share of the HBM roofline: the bytes each decode
  step must read (every weight once, plus the live KV once: each live sample's own positions and its group's
  shared prompt blocks once per group), summed over the steps and divided by the bandwidth measured in this run
  (a device-to-device copy, read + write), over the decode seconds;
* prefill MFU (the sampler's prefill: each prompt once, logits at its last position) and update MFU (packed
  forward + backward over the batch, micro-batches of ``--micro`` rows), FLOPs from ``rlhf.ops.flops`` over the
  card's dense bf16 peak (``rlhf.ops.hardware.peak_flops``);
* the packed pass through the chosen attention kernel against the bucketed SDPA fallback (time ratio, and the
  largest log-prob difference); first model only;
* the step's breakdown: generate (prefill + decode), the old and reference log-prob passes (one forward each,
  measured once), the update; no FSDP, reshard, reward or optimizer (those are ``bench/train_step.py``'s);
* the same decode through HF ``generate`` (static cache, which transformers compiles on CUDA) on the same
  prompts, and our generation's tokens/s over HF's; first model only (its compile is the run's longest wait).

The last line is one JSON object; ``decode_roofline_fraction``, ``prefill_mfu`` and ``update_mfu`` are the first
model's fractions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf.models import attention_backend  # noqa: E402
from rlhf.models import varlen_attention as va  # noqa: E402
from rlhf.models.packed import packed_forward_log_probs  # noqa: E402
from rlhf.ops.flops import matmul_params, model_flops_per_token  # noqa: E402
from rlhf.ops.hardware import device_description, peak_flops  # noqa: E402
from rlhf.rollout import SamplingParams  # noqa: E402
from rlhf.rollout.kv_cache import kv_bytes_per_token  # noqa: E402
from rlhf.rollout.sampler import Sampler  # noqa: E402

PAD = 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, repeats: int = 1) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls (after the caller's warm-up) and the last result."""
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once: 2 x size moved)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t, _ = timed(device, lambda: [dst.copy_(src) for _ in range(5)], repeats=3)
    return 2 * nbytes * 5 / t


def load_config(name: str, tiny: bool):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(ROOT / "configs" / "models" / name)
    if tiny:
        cfg.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512))
    return cfg


def build_model(cfg, device: torch.device, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.generation_config.pad_token_id = PAD
    return model


def stop_ids(vocab: int, mean_response: float) -> list[int]:
    """The top ``vocab / mean`` ids: a near-uniform random model stops with probability ~``1 / mean`` per token."""
    k = max(1, round(vocab / mean_response))
    return list(range(vocab - k, vocab))


def kv_read_bytes(prompt: int, lengths: list[int], n: int, per_token: int) -> int:
    """KV bytes the decode steps must read: the live KV once. A response of ``L`` tokens is decoded in ``L - 1``
    steps (its first token comes from prefill), step ``j`` reading its own ``j`` positions; the group's prompt
    (``n`` consecutive samples share its blocks) counts once per step while any of its samples is live."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    own = int(((lens - 1).clamp(min=0) * lens // 2).sum())
    group_steps = int((lens.view(-1, n).max(1).values - 1).clamp(min=0).sum())  # steps a group has a live sample
    return per_token * (own + prompt * group_steps)


@contextmanager
def bucketed_sdpa():
    """The packed pass on today's fallback (bucketed SDPA), whatever kernel the rule picks."""
    real = va.varlen_kernel
    va.varlen_kernel = lambda *a, **k: None
    try:
        yield
    finally:
        va.varlen_kernel = real


def packed_pass(model, ids, mask, R: int, micro: int, backward: bool) -> list[torch.Tensor]:
    """Log-probs of the batch in micro-batches of ``micro`` rows; with ``backward``, a GRPO-like loss's backward
    (gradients dropped after each micro-batch: the update's compute without an optimizer)."""
    outs = []
    for i in range(0, ids.shape[0], micro):
        sl = slice(i, i + micro)
        with torch.set_grad_enabled(backward):
            lp, _ = packed_forward_log_probs(model, ids[sl], mask[sl], response_length=R)
            if backward:
                resp = mask[sl, -R:].to(lp.dtype)
                (lp * resp).sum().div(resp.sum()).backward()
        outs.append(lp.detach())
    if backward:
        for p in model.parameters():
            p.grad = None
    return outs


def run_model(name: str, args, device: torch.device, dtype: torch.dtype, bw: float, peak: float | None,
              extras: bool) -> dict:
    """One model's figures; ``extras``: also the bucketed-SDPA comparison and HF generate (the first model's)."""
    cfg = load_config(name, args.tiny)
    # rows per update micro-batch: --micro at the 1.5B width, fewer for wider models (activations grow with it)
    micro = max(1, round(args.micro * min(1.0, (1536 / cfg.hidden_size) ** 1.5)))
    model = build_model(cfg, device, dtype)
    prompts_n, n, P, R = args.prompts, args.n, args.prompt, args.response
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size - 1, (P,), generator=g).tolist() for _ in range(prompts_n)]
    stops = stop_ids(cfg.vocab_size, args.mean_response)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=R, seed=1, stop_token_ids=stops)
    row: dict = {"model": name, "params": sum(p.numel() for p in model.parameters()), "batch": prompts_n * n}

    # --- generate: our sampler (CUDA graphs on a GPU) ---
    t = time.perf_counter()
    sampler = Sampler(cfg, model.state_dict(), pad_token_id=PAD, max_num_seqs=prompts_n * n, device=device,
                      use_cuda_graph=device.type == "cuda", max_seq_len=P + R)
    sampler.generate(prompts, params)  # warm-up: graph capture, kernel choice
    row["sampler_setup_s"] = time.perf_counter() - t
    gen_s, out = timed(device, lambda: sampler.generate(prompts, params))
    lengths = out.response_lengths.tolist()
    st = out.stats
    tokens = sum(lengths)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = int(st["decode_steps"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, dtype)
    must_read = steps * weight_bytes + kv_read_bytes(P, lengths, n, per_token)
    row.update(decode_kernel=sampler.decode_attention.name, response_mean=tokens / len(lengths),
               response_p50=statistics.median(lengths), response_max=max(lengths), decode_steps=steps,
               decode_s=st["decode_s"], prefill_s=st["prefill_s"], generate_s=gen_s,
               decode_tok_s=(tokens - len(lengths)) / st["decode_s"], generate_tok_s=tokens / gen_s,
               decode_roofline_fraction=must_read / bw / st["decode_s"])
    if extras and args.cascade:  # eager decode with the shared-prompt cascade forced on, against it off
        from rlhf.rollout import cascade_attention

        for on in (False, True):
            kernel = cascade_attention.decode_attention(device, dtype) if on else None
            s = Sampler(cfg, model.state_dict(), pad_token_id=PAD, max_num_seqs=prompts_n * n, device=device,
                        max_seq_len=P + R, decode_attention=kernel, cascade_attention=False)
            s.generate(prompts, params)
            _, o = timed(device, lambda: s.generate(prompts, params))
            row[f"eager_decode_tok_s_cascade_{'on' if on else 'off'}"] = (
                int(o.response_lengths.sum()) - len(lengths)) / o.stats["decode_s"]
            del s, o
        row["eager_cascade_speedup"] = row["eager_decode_tok_s_cascade_on"] / row["eager_decode_tok_s_cascade_off"]
    lm = 2.0 * matmul_params(cfg)["lm_head"]
    prefill_flops = prompts_n * (P * (model_flops_per_token(cfg, P, training=False) - lm) + lm)
    row["prefill_mfu"] = prefill_flops / st["prefill_s"] / peak if peak else None
    del sampler, out

    # --- the training layout: rows [prompt ; response], right-padded ---
    ids = torch.full((len(lengths), P + R), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, L in enumerate(lengths):
        ids[i, :P] = torch.tensor(prompts[i // n])
        ids[i, P:P + L] = torch.randint(1, cfg.vocab_size, (L,), generator=g)
        mask[i, :P + L] = 1
    ids, mask = ids.to(device), mask.to(device)
    seq = [P + L for L in lengths]
    train_flops = sum(s * model_flops_per_token(cfg, s, training=True) for s in seq)
    model.train()  # dropout is 0 in these configs; train() is what the actor runs
    packed_pass(model, ids, mask, R, micro, backward=True)  # warm-up (flex compiles here)
    upd_s, _ = timed(device, lambda: packed_pass(model, ids, mask, R, micro, backward=True))
    lp_s, lp = timed(device, lambda: packed_pass(model, ids, mask, R, micro, backward=False))
    row.update(update_s=upd_s, logprob_s=lp_s, micro_rows=micro,
               update_mfu=train_flops / upd_s / peak if peak else None,
               packed_kernel=attention_backend.choose("packed", attention_backend.probe(device, dtype)))
    if extras and not args.skip_sdpa:
        with bucketed_sdpa():
            packed_pass(model, ids, mask, R, micro, backward=True)
            sdpa_s, _ = timed(device, lambda: packed_pass(model, ids, mask, R, micro, backward=True))
            _, lp_ref = timed(device, lambda: packed_pass(model, ids, mask, R, micro, backward=False))
        resp = mask[:, -R:].bool()
        diff = max(float(((a - b).abs() * resp[i * micro:(i + 1) * micro]).max())
                   for i, (a, b) in enumerate(zip(lp, lp_ref)))
        row.update(update_sdpa_s=sdpa_s, update_speedup_vs_sdpa=sdpa_s / upd_s, logprob_max_diff_vs_sdpa=diff)
    step = gen_s + 2 * lp_s + upd_s
    row["step_breakdown"] = {"generate": gen_s, "old_logprob": lp_s, "ref_logprob": lp_s, "update": upd_s,
                             "total": step}
    model.eval()
    del ids, mask, lp

    # --- HF generate on the same prompts (static cache; transformers compiles its forward on CUDA) ---
    if extras and not args.skip_hf:
        model.set_attn_implementation("sdpa")  # HF's own attention (the packed passes switched it to ours)
        hf_ids = torch.tensor(prompts, device=device).repeat_interleave(n, 0)
        kw = dict(max_new_tokens=R, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD,
                  eos_token_id=stops, cache_implementation="static")
        with torch.no_grad():
            model.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), **kw)  # warm-up: compile
            hf_s, gen = timed(device, lambda: model.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), **kw))
        new = gen[:, P:].cpu()
        hit = torch.isin(new, torch.tensor(stops))
        hf_len = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
        row.update(hf_generate_s=hf_s, hf_tok_s=int(hf_len.sum()) / hf_s,
                   generate_speedup_vs_hf=(tokens / gen_s) / (int(hf_len.sum()) / hf_s))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def report(row: dict) -> None:
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"== {row['model']} ({row['params'] / 1e9:.2f} B params), batch {row['batch']}: responses mean "
          f"{row['response_mean']:.0f}, p50 {row['response_p50']:.0f}, max {row['response_max']}")
    print(f"  decode [{row['decode_kernel']}]: {row['decode_tok_s']:.0f} tok/s over {row['decode_steps']} steps, "
          f"HBM roofline fraction {f(row['decode_roofline_fraction'])}")
    print(f"  prefill MFU {f(row['prefill_mfu'])}   update MFU [{row['packed_kernel']}] {f(row['update_mfu'])}")
    if "update_sdpa_s" in row:
        print(f"  packed fwd+bwd vs bucketed SDPA: {row['update_s']:.3f} s vs {row['update_sdpa_s']:.3f} s = "
              f"{row['update_speedup_vs_sdpa']:.2f}x; max |log-prob diff| {row['logprob_max_diff_vs_sdpa']:.2e}")
    b = row["step_breakdown"]
    print("  step: " + "  ".join(f"{k} {v:.2f} s ({v / b['total']:.0%})" for k, v in b.items() if k != "total")
          + f"  total {b['total']:.2f} s")
    if "eager_cascade_speedup" in row:
        print(f"  eager decode, cascade on vs off: {row['eager_decode_tok_s_cascade_on']:.0f} vs "
              f"{row['eager_decode_tok_s_cascade_off']:.0f} tok/s = {row['eager_cascade_speedup']:.2f}x")
    if "hf_tok_s" in row:
        print(f"  generate: ours {row['generate_tok_s']:.0f} tok/s, HF generate (static cache"
              f"{' + compile' if row.get('hf_compiled') else ''}) {row['hf_tok_s']:.0f} tok/s = "
              f"{row['generate_speedup_vs_hf']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and a small batch (CPU CI)")
    ap.add_argument("--models", default="Qwen2.5-1.5B,Qwen2.5-7B", help="comma list of configs/models/ names")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 32; --tiny 2)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default 8; --tiny 4)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; --tiny 16)")
    ap.add_argument("--response", type=int, default=None, help="longest response (default 1024; --tiny 24)")
    ap.add_argument("--mean-response", type=float, default=None, help="mean of the long-tail mix (default 350)")
    ap.add_argument("--micro", type=int, default=None,
                    help="rows per micro-batch of the update at the 1.5B width, scaled down for wider models "
                         "(default 32: ~19k tokens)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out HF generate")
    ap.add_argument("--cascade", action="store_true",
                    help="also eager decode with the shared-prompt cascade on vs off (first model; not in the 6 min)")
    ap.add_argument("--skip-sdpa", action="store_true", help="leave out the bucketed-SDPA comparison")
    args = ap.parse_args()
    tiny = dict(prompts=2, n=4, prompt=16, response=24, mean_response=10.0, micro=8)
    full = dict(prompts=32, n=8, prompt=256, response=1024, mean_response=350.0, micro=32)
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_step.py: --device cuda but no CUDA device is visible (CPU: --device cpu --tiny)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    picked = attention_backend.log_choices(device, dtype)
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    peak = peak_flops(device, dtype)
    print(f"device {device_description(device).get('name')}; copy bandwidth {bw / 1e9:.0f} GB/s; dense peak "
          f"{(peak or 0) / 1e12:.1f} TFLOP/s ({str(dtype).removeprefix('torch.')})", flush=True)
    names = args.models.split(",")[:1] if args.tiny else args.models.split(",")
    rows = []
    for i, name in enumerate(names):
        row = run_model(name, args, device, dtype, bw, peak, extras=i == 0)
        row["hf_compiled"] = device.type == "cuda"
        report(row)
        rows.append(row)
    first = rows[0]
    print(json.dumps({"bench": "gpu_step", "device": device_description(device), "dtype": str(dtype),
                      "attn_backends": picked, "copy_bandwidth_gb_s": bw / 1e9, "peak_tflops": (peak or 0) / 1e12,
                      "tiny": args.tiny, "seconds": time.perf_counter() - t0,
                      "decode_roofline_fraction": first["decode_roofline_fraction"],
                      "prefill_mfu": first["prefill_mfu"], "update_mfu": first["update_mfu"], "models": rows}))


if __name__ == "__main__":
    main()
