"""Benchmark: FP8 against bf16 on one GPU at the Qwen2.5-7B shape: rollout decode and the training update.

    python bench/fp8_step.py                      # both parts, the whole 7B shape (an H100 / H200)
    python bench/fp8_step.py --part decode --layers 8 --new-tokens 64   # a quicker look (decode: 8 of 28 layers)

1. ``decode``: the project's sampler (``rlhf.rollout.Sampler``, CUDA graphs as ``rollout.compile``) at
   ``--batch`` sequences (256), once from the bf16 weights and once from the FP8 rollout weights that
   the reshard makes (``gather_rollout_weights(..., quantization="fp8")``: 128 x 128 block scales by
   default, ``--scale channel`` for per-row). Reports decode tokens/s of each and the ratio, whether the
   FP8 matmul (``torch._scaled_mm``) ran or the weights were dequantized (``fp8_kernel``), and the rollout
   weight bytes of each. A random model rarely samples EOS, so every sequence decodes ``--new-tokens``.
2. ``update``: ``--update-layers`` decoder layers (8) of the 7B shape (HF ``Qwen2DecoderLayer``), forward + backward
   + AdamW on ``--tokens`` tokens, in bf16 and with torchao's float8 training on the same layers
   (``rlhf.models.fp8_training.apply_fp8_training``, what ``actor.fp8`` applies), both under
   ``torch.compile`` (torchao's casts are fused by it; ``--no-compile`` to compare eager). Reports the
   median step time of each, the ratio, and the relative difference of the first step's grad norms
   from the same weights and inputs.

Needs a CUDA GPU with FP8 matmuls (sm89+); elsewhere it refuses in one line. The last line printed
is one JSON object with every figure (and the date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "configs" / "models" / "Qwen2.5-7B"


def _config(layers: int):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(MODEL))
    cfg.num_hidden_layers = layers
    return cfg


def _sync() -> None:
    torch.cuda.synchronize()


def bench_decode(args, device: torch.device) -> dict:
    import transformers

    from rlhf.models import fp8
    from rlhf.rollout import Sampler, SamplingParams
    from rlhf.rollout.reshard import gather_rollout_weights

    cfg = _config(args.layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, cfg.vocab_size - 100, (args.batch, args.prompt), generator=gen).tolist()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[], seed=1)
    out: dict = {}
    for name in ("bf16", "fp8"):
        if name == "bf16":
            weights = {n: p.detach() for n, p in model.named_parameters()}
        else:
            weights, _ = gather_rollout_weights(model, quantization="fp8", quantization_scale=args.scale)
        wbytes = sum(t.numel() * t.element_size() for t in weights.values())
        sampler = Sampler(cfg, weights, pad_token_id=0, device=device, dtype=torch.bfloat16,
                          max_num_seqs=args.batch, max_seq_len=args.prompt + args.new_tokens,
                          use_cuda_graph=not args.eager)
        del weights
        if name == "fp8":
            out["fp8_kernel"] = isinstance(sampler.weights.layers[0].qkv_w, fp8.Fp8Weight)
        rates = []
        for rep in range(args.repeats + 1):  # the first call captures the graphs
            _sync()
            res = sampler.generate(prompts, params, step=rep)
            _sync()
            if rep:
                rates.append(res.stats["tokens_generated"] / max(res.stats["decode_s"], 1e-9))
        out[f"decode_tokens_per_s_{name}"] = statistics.median(rates)
        out[f"rollout_weight_gib_{name}"] = wbytes / 2**30
        print(f"[fp8_step] decode {name}: {out[f'decode_tokens_per_s_{name}']:.0f} tokens/s "
              f"(median of {args.repeats}), rollout weights {wbytes / 2**30:.2f} GiB", flush=True)
        del sampler
        torch.cuda.empty_cache()
    out["decode_ratio"] = out["decode_tokens_per_s_fp8"] / out["decode_tokens_per_s_bf16"]
    return out


def bench_update(args, device: torch.device) -> dict:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    from rlhf.models.fp8_training import apply_fp8_training

    cfg = _config(args.update_layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        base = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(Qwen2DecoderLayer(cfg, i)
                                                                  for i in range(args.update_layers))})
        base = base.to(torch.bfloat16)
        rope = Qwen2RotaryEmbedding(cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    seq = min(args.tokens, 4096)
    rows = max(1, args.tokens // seq)
    x = torch.randn(rows, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16, generator=None)
    pos = torch.arange(seq, device=device)[None].expand(rows, -1)
    cos_sin = rope(x, pos)

    def forward(mod, h):
        for layer in mod["layers"]:
            h = layer(h, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h
        return h.float().pow(2).mean()

    out: dict = {}
    for name in ("bf16", "fp8"):
        mod = base if name == "bf16" else _fresh(base, state)
        if name == "fp8":
            out["fp8_share"] = apply_fp8_training(mod, device)
        run = torch.compile(forward) if not args.no_compile else forward
        opt = torch.optim.AdamW(mod.parameters(), lr=1e-5, fused=True)
        times, norm = [], None
        for step in range(args.repeats + 2):  # two warm-up steps (compilation)
            _sync()
            t = time.perf_counter()
            loss = run(mod, x)
            loss.backward()
            g = torch.nn.utils.clip_grad_norm_(mod.parameters(), 1e9)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync()
            if step == 0:
                norm = float(g)
            if step >= 2:
                times.append(time.perf_counter() - t)
        del opt  # the next run's optimizer state replaces this one's
        out[f"update_s_{name}"] = statistics.median(times)
        out[f"grad_norm_{name}"] = norm
        print(f"[fp8_step] update {name}: {out[f'update_s_{name}'] * 1e3:.1f} ms per step (median of {args.repeats}), "
              f"first grad norm {norm:.4g}", flush=True)
        torch.cuda.empty_cache()
    out["update_ratio"] = out["update_s_bf16"] / out["update_s_fp8"]
    out["grad_norm_rel_diff"] = abs(out["grad_norm_fp8"] - out["grad_norm_bf16"]) / out["grad_norm_bf16"]
    return out


def _fresh(base: torch.nn.Module, state: dict) -> torch.nn.Module:
    """A copy of ``base`` at the bf16 run's starting weights (the bf16 run has stepped ``base``)."""
    import copy

    mod = copy.deepcopy(base)
    mod.load_state_dict(state)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("decode", "update", "both"), default="both")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers of the 7B shape (28: all)")
    ap.add_argument("--batch", type=int, default=256, help="decode: sequences decoded at once")
    ap.add_argument("--prompt", type=int, default=128, help="decode: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="decode: tokens generated per sequence")
    ap.add_argument("--scale", choices=("block", "channel"), default="block", help="FP8 rollout scales")
    ap.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    ap.add_argument("--update-layers", type=int, default=8, help="update: decoder layers of the 7B shape trained")
    ap.add_argument("--tokens", type=int, default=16384, help="update: tokens per step")
    ap.add_argument("--no-compile", action="store_true", help="update: eager (no torch.compile)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from rlhf.models.fp8 import supports_fp8

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not supports_fp8(device):
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else "no CUDA device"
        sys.exit(f"bench/fp8_step.py: needs a CUDA GPU with FP8 matmuls (sm89+: Ada, Hopper, Blackwell); found {what}")
    result: dict = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(device),
                    "torch": torch.__version__, "decode_layers": args.layers, "update_layers": args.update_layers}
    if args.part in ("decode", "both"):
        result.update(bench_decode(args, device))
    if args.part in ("update", "both"):
        result.update(bench_update(args, device))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
