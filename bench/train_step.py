"""Benchmark of the update phase: padding-free vs padded, dynamic vs fixed micro-batches,
activation-checkpointing memory, LoRA sync bytes and reference-model memory.

What it measures, all in one run (medians over ``--repeats``, configurations interleaved
per repeat so a noisy shared machine hits them alike):

* tokens/s of one PPO-style update step (forward + backward + AdamW step) on a batch whose
  response lengths spread uniformly from 16 to ``--max-response`` after ~32-token prompts:
  - padded:   fixed micro-batches of ``--micro-batch`` sequences, the project's padded
              ``rlhf.models.logprobs.forward_log_probs`` (logits only for the response slice);
  - packed:   the same fixed micro-batches, padding-free (``packed_forward_log_probs``);
  - dynamic:  padding-free, token-budget micro-batches with budget
              ``micro_batch * (prompt + max_response)`` (the padded micro-batch's size);
  tokens/s counts real tokens only (identical numerator for every configuration).
* peak memory of forward+backward over the whole batch with and without activation
  checkpointing, each in a fresh subprocess (CPU: polled RSS growth; CUDA:
  ``max_memory_allocated``).
* LoRA on the ~100M Qwen2-like config (hidden 768, 12 layers, vocab 32000; built on the
  meta device, no compute): bytes the per-step rollout sync moves with LoRA (adapters
  only) vs full fine-tuning (all weights), and the reference model's extra memory
  (0 with LoRA: it is the same module with adapters disabled).

Run:  python bench/train_step.py [--quick]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf.data.batching import make_token_budget_micro_batches, seq_lens_from_mask  # noqa: E402
from rlhf.models.activation_checkpointing import apply_ac  # noqa: E402
from rlhf.models.lora import apply_lora  # noqa: E402
from rlhf.models.packed import packed_forward_hidden, packed_forward_log_probs  # noqa: E402

try:
    from rlhf.models.logprobs import forward_log_probs as padded_forward_log_probs
except ImportError:  # the bench also runs where the trainer's module is not there yet

    def padded_forward_log_probs(model, input_ids, attention_mask, *, response_length, temperature=1.0,
                                 compute_entropy=False):
        R = response_length
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False,
                    logits_to_keep=R + 1)
        logits = out.logits[:, :-1].float() / temperature
        lp = logits.gather(-1, input_ids[:, -R:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        return lp, None


def model_config(args) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or max(args.heads // 2, 1),
        max_position_embeddings=args.prompt + args.max_response + 8, tie_word_embeddings=True, use_cache=False,
    )


def make_batch(args, device):
    """input_ids / attention_mask [B, P + R]: prompts of 24..P tokens, responses 16..R_max."""
    g = torch.Generator().manual_seed(0)
    B, P, R = args.batch, args.prompt, args.max_response
    resp = torch.linspace(16, R, B).round().long()[torch.randperm(B, generator=g)]
    prompt = torch.randint(max(P - 8, 1), P + 1, (B,), generator=g)
    col = torch.arange(P + R)
    mask = ((col[None] >= P - prompt[:, None]) & (col[None] < P + resp[:, None])).long()
    ids = torch.randint(2, args.vocab, (B, P + R), generator=g) * mask
    adv = torch.randn(B, R, generator=g)
    return ids.to(device), mask.to(device), adv.to(device)


def compute_dtype(args) -> torch.dtype | None:
    """--dtype bfloat16: bf16 autocast over fp32 weights (as FSDP2 mixed precision); else None."""
    return torch.bfloat16 if args.dtype == "bfloat16" else None


def train_step(model, opt, ids, mask, adv, R, micro_batches, fn, dtype=None):
    """One update: token-mean policy-gradient surrogate, global normaliser; returns seconds."""
    resp_mask = mask[:, -R:].float()
    n_tok = resp_mask.sum()
    sync(ids.device)
    t0 = time.perf_counter()
    for mb in micro_batches:
        idx = torch.tensor(mb, device=ids.device)
        with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
            lp, _ = fn(model, ids[idx], mask[idx], response_length=R)
        loss = -(lp * adv[idx] * resp_mask[idx]).sum() / n_tok
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(ids.device)
    return time.perf_counter() - t0


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def update_mfu(config, lens: list[int], seconds: float, device, dtype=None) -> float | None:
    """Model FLOPs of one update over the batch (rlhf.ops.flops conventions) / seconds / the
    device's peak for the compute dtype; None where the peak is unknown."""
    from rlhf.ops.flops import model_flops_per_token
    from rlhf.ops.hardware import peak_flops

    peak = peak_flops(device, dtype or torch.float32)
    if not peak:
        return None
    flops = sum(n * model_flops_per_token(config, n, training=True) for n in lens)
    return round(flops / seconds / peak, 4)


def peak_memory(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def throughput(args, device) -> dict:
    torch.manual_seed(0)
    ids, mask, adv = make_batch(args, device)
    R, B = args.max_response, args.batch
    base = transformers.Qwen2ForCausalLM(model_config(args)).to(device)
    base.set_attn_implementation("sdpa")
    models, opts = {}, {}
    for name in ("padded", "packed", "dynamic"):
        m = type(base)(base.config).to(device)
        m.load_state_dict(base.state_dict())
        m.set_attn_implementation("sdpa")
        models[name] = m.train()
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-7)
    fixed = [list(range(i, min(i + args.micro_batch, B))) for i in range(0, B, args.micro_batch)]
    budget = args.micro_batch * (args.prompt + R)
    lens = seq_lens_from_mask(mask)
    dynamic = make_token_budget_micro_batches(lens, budget)
    plans = {
        "padded": (fixed, padded_forward_log_probs),
        "packed": (fixed, packed_forward_log_probs),
        "dynamic": (dynamic, packed_forward_log_probs),
    }
    times: dict[str, list[float]] = {k: [] for k in plans}
    for name, (mbs, fn) in plans.items():  # warm-up
        train_step(models[name], opts[name], ids, mask, adv, R, mbs, fn, compute_dtype(args))
    for _ in range(args.repeats):
        for name, (mbs, fn) in plans.items():
            times[name].append(train_step(models[name], opts[name], ids, mask, adv, R, mbs, fn, compute_dtype(args)))
    real = int(mask.sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: real / v for k, v in med.items()}
    mfu = update_mfu(base.config, lens, med["dynamic"], device, compute_dtype(args))
    mb_tokens = lambda mbs: [sum(lens[i] for i in mb) for mb in mbs]  # noqa: E731
    return {
        "batch": B, "prompt": args.prompt, "max_response": R, "real_tokens": real,
        "padded_tokens": int(mask.numel()), "padding_fraction": round(1 - real / mask.numel(), 4),
        "mfu_dynamic": mfu, "peak_mem_bytes_update": peak_memory(device),
        "tokens_per_s_padded": round(tps["padded"], 1),
        "tokens_per_s_packed": round(tps["packed"], 1),
        "tokens_per_s_dynamic": round(tps["dynamic"], 1),
        "speedup_packed_vs_padded": round(tps["packed"] / tps["padded"], 3),
        "speedup_dynamic_vs_fixed_packed": round(tps["dynamic"] / tps["packed"], 3),
        "speedup_dynamic_packed_vs_padded": round(tps["dynamic"] / tps["padded"], 3),
        "fixed_micro_batches": len(fixed), "dynamic_micro_batches": len(dynamic), "token_budget": budget,
        "fixed_max_mb_tokens": max(mb_tokens(fixed)), "dynamic_max_mb_tokens": max(mb_tokens(dynamic)),
        "fixed_mb_token_spread": max(mb_tokens(fixed)) - min(mb_tokens(fixed)),
        "dynamic_mb_token_spread": max(mb_tokens(dynamic)) - min(mb_tokens(dynamic)),
        "step_seconds_median": {k: round(v, 3) for k, v in med.items()},
    }


class PeakRSS:
    """Peak resident-set growth over a block, sampled from /proc/self/statm every ~0.5 ms.
    (``ru_maxrss`` cannot be reset and already holds the import/model-init peak.)"""

    def __enter__(self) -> "PeakRSS":
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.0005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def memory_child(args, device, use_ac: bool, what: str) -> dict:
    """Peak extra memory of forward+backward of the whole batch in one packed micro-batch.
    ``what="logprobs"``: the actor loss (incl. the un-checkpointed LM-head logits);
    ``what="hidden"``: the decoder stack only (what checkpointing acts on)."""
    torch.manual_seed(0)
    ids, mask, adv = make_batch(args, device)
    model = transformers.Qwen2ForCausalLM(model_config(args)).to(device).train()
    if use_ac:
        apply_ac(model)
    R = args.max_response

    def fwd_bwd():
        dtype = compute_dtype(args)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # backward runs outside
            if what == "hidden":
                h = packed_forward_hidden(model, ids, mask, response_length=R)
                loss = (h.float().pow(2).mean(-1) * adv * mask[:, -R:]).sum()
            else:
                lp, _ = packed_forward_log_probs(model, ids, mask, response_length=R)
                loss = -(lp * adv * mask[:, -R:]).sum()
        loss.backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fwd_bwd()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with PeakRSS() as rss:
            fwd_bwd()
        before, peak = rss.base, rss.peak
    return {"peak_extra_bytes": int(peak - before)}


def activation_memory(args, device, argv: list[str]) -> dict:
    out: dict = {"peak_mem_method": "cuda max_memory_allocated" if device.type == "cuda"
                 else "RSS growth (polled), fresh process"}
    for what in ("logprobs", "hidden"):
        res = {}
        for tag in ("noac", "ac"):
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_mem-child", f"{tag}:{what}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res[tag] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"]
        suffix = "" if what == "logprobs" else "_decoder_only"
        out[f"peak_mem_bytes_no_ac{suffix}"] = res["noac"]
        out[f"peak_mem_bytes_ac{suffix}"] = res["ac"]
        out[f"peak_mem_ratio_ac_vs_no_ac{suffix}"] = round(res["ac"] / max(res["noac"], 1), 3)
    return out


def lora_figures(rank: int) -> dict:
    """~100M Qwen2-like model on the meta device: bytes per rollout sync, reference memory."""
    cfg = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        full = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    bpe = 2  # bf16 rollout weights
    full_params = sum(p.numel() for p in full.parameters())  # tied embedding counted once
    out = {"lora_model_params": full_params, "full_sync_bytes": full_params * bpe, "lora_rank": rank}
    for tag, targets in (("all_linear", "all-linear"), ("attn_only", ["q_proj", "k_proj", "v_proj", "o_proj"])):
        with torch.device("meta"):
            base = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        peft_model = apply_lora(base, lora_rank=rank, lora_alpha=2 * rank, target_modules=targets)
        adapter = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        out[f"lora_sync_bytes_{tag}"] = adapter * bpe
        out[f"lora_sync_fraction_{tag}"] = round(adapter / full_params, 5)
    out["reference_extra_bytes_full_ft"] = full_params * bpe  # a second frozen copy of the weights
    out["reference_extra_bytes_lora"] = 0  # reference_context(): the same module, adapters disabled
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small batch / lengths, 3 repeats (~1 min on 2 CPU cores)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 8/3 x hidden)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default heads // 2")
    ap.add_argument("--preset", choices=["qwen2.5-0.5b"], default=None,
                    help="a real architecture's shape (overrides hidden/layers/heads/vocab)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype of the update (bfloat16: autocast over fp32 weights)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared machine OpenMP threads spin against other "
                    "processes and a step gets ~20x slower; 0 keeps torch's default)")
    ap.add_argument("--_mem-child", dest="mem_child", choices=["ac:logprobs", "noac:logprobs", "ac:hidden", "noac:hidden"], help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.max_response, args.hidden, args.layers, args.heads, args.vocab = 8, 128, 128, 2, 4, 8192
        args.micro_batch = 2
    if args.preset == "qwen2.5-0.5b":
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, args.intermediate = 896, 24, 14, 2, 151936, 4864
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/train_step.py: --device cuda but no CUDA device is visible")
    if args.mem_child:
        tag, what = args.mem_child.split(":")
        print(json.dumps(memory_child(args, device, tag == "ac", what)))
        return

    figures: dict = {"device": str(device), "dtype": args.dtype, "torch_threads": torch.get_num_threads(), "quick": args.quick,
                     "model": f"qwen2 h{args.hidden} L{args.layers} V{args.vocab}", "repeats": args.repeats}
    t = throughput(args, device)
    figures.update(t)
    print(f"update phase tokens/s  padded {t['tokens_per_s_padded']:.0f}  packed {t['tokens_per_s_packed']:.0f}  "
          f"dynamic {t['tokens_per_s_dynamic']:.0f}  (update MFU, dynamic: {t['mfu_dynamic']})")
    print(f"  padding-free vs padded: {t['speedup_packed_vs_padded']:.2f}x (goal >= 1.8x); "
          f"dynamic vs fixed (both packed): {t['speedup_dynamic_vs_fixed_packed']:.2f}x; "
          f"dynamic+packed vs padded: {t['speedup_dynamic_packed_vs_padded']:.2f}x")
    print(f"  micro-batches fixed {t['fixed_micro_batches']} (max {t['fixed_max_mb_tokens']} tok, spread "
          f"{t['fixed_mb_token_spread']}) vs dynamic {t['dynamic_micro_batches']} (max {t['dynamic_max_mb_tokens']}"
          f" tok <= budget {t['token_budget']}, spread {t['dynamic_mb_token_spread']})")
    m = activation_memory(args, device, argv)
    figures.update(m)
    print(f"peak fwd+bwd memory, actor loss: no AC {m['peak_mem_bytes_no_ac'] / 2**20:.1f} MiB, AC "
          f"{m['peak_mem_bytes_ac'] / 2**20:.1f} MiB ({m['peak_mem_ratio_ac_vs_no_ac']:.2f}x); decoder only: "
          f"{m['peak_mem_bytes_no_ac_decoder_only'] / 2**20:.1f} -> {m['peak_mem_bytes_ac_decoder_only'] / 2**20:.1f}"
          f" MiB ({m['peak_mem_ratio_ac_vs_no_ac_decoder_only']:.2f}x)")
    lo = lora_figures(args.lora_rank)
    figures.update(lo)
    print(f"LoRA r={args.lora_rank} on {lo['lora_model_params'] / 1e6:.1f}M params: per-step sync "
          f"{lo['lora_sync_bytes_all_linear'] / 2**20:.2f} MiB all-linear ({100 * lo['lora_sync_fraction_all_linear']:.2f}%),"
          f" {lo['lora_sync_bytes_attn_only'] / 2**20:.2f} MiB attention-only "
          f"({100 * lo['lora_sync_fraction_attn_only']:.2f}%) vs full {lo['full_sync_bytes'] / 2**20:.1f} MiB; "
          f"reference extra memory {lo['reference_extra_bytes_lora']} B (LoRA) vs "
          f"{lo['reference_extra_bytes_full_ft'] / 2**20:.1f} MiB (full FT)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
