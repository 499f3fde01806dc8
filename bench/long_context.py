"""Ulysses sequence parallelism on one long sequence: peak activation memory per rank and
tokens/s of one actor update, sp=1 (1 rank) vs sp=2 (2 gloo ranks), in one run.

    python bench/long_context.py                       # 16k tokens, ~3 min on a 2-core CPU
    python bench/long_context.py --tokens 8192 --layers 2

Why: a sequence must fit one rank's activation memory unless it is split. With sp=2 each rank
runs the embeddings, MLPs, norms and LM head on half the tokens and attention on half the
heads, so the activation peak per rank should be close to 1/2 (the weights, gradients and
optimizer state are small here on purpose: a narrow model, so activations dominate).

Each rank measures the growth of its peak resident memory (VmHWM, reset before the update)
over its resident memory just before the update: one padding-free PPO update (forward,
backward, optimizer step) of one row of ``--tokens`` tokens (half prompt, half response), no
activation checkpointing. The sp=2 ranks run one thread each, the sp=1 rank one thread, so
tokens/s per rank compares the same compute. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_bytes() -> float:
    with open("/proc/self/status") as f:
        return next(float(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))


def _worker(rank: int, world: int, store: str, model_dir: str, tokens: int, out: str) -> None:
    from rlhf.models.parallel import ParallelDims
    from rlhf.ops.memory import _read_hwm_bytes, _reset_hwm
    from rlhf.schema.batch import RolloutBatch
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    mesh = ParallelDims(dp=1, tp=1, pp=1, world_size=world, sp=world).build_mesh("cpu")
    cfg = ActorConfig(lr=1e-4, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=True,
                      ppo_max_token_len_per_gpu=tokens, log_prob_max_token_len_per_gpu=tokens)
    actor = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=True, mixed_precision=False), mesh,
                         torch.device("cpu"), actor_cfg=cfg, total_steps=1)
    P = R = tokens // 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, actor.hf_config.vocab_size, (1, P + R), generator=g)
    lp = -torch.rand(1, R, generator=g)
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), responses=ids[:, P:],
                         response_mask=torch.ones(1, R), index=torch.zeros(1, dtype=torch.long),
                         rollout_log_probs=lp, truncated=torch.zeros(1, dtype=torch.bool), old_log_probs=lp,
                         ref_log_probs=lp, advantages=torch.randn(1, R, generator=g))
    dist.barrier()
    before = _rss_bytes()
    _reset_hwm()
    t0 = time.perf_counter()
    metrics = actor.update_policy(batch, mini_batch_rows=1, temperature=1.0, max_response_length=R)
    seconds = time.perf_counter() - t0
    peak = _read_hwm_bytes() - before
    torch.save({"peak_bytes": peak, "seconds": seconds, "loss": metrics["actor/loss"]}, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, model_dir: str, tokens: int, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"sp{world}")
    store = os.path.join(tmp, f"store{world}")
    mp.start_processes(_worker, args=(world, store, model_dir, tokens, out), nprocs=world, start_method="spawn")
    return [torch.load(f"{out}.rank{r}") for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    args = ap.parse_args()
    from rlhf.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        write_tiny_model(model_dir, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                         intermediate_size=4 * args.hidden, max_positions=2 * args.tokens)
        res = {1: run(1, model_dir, args.tokens, tmp), 2: run(2, model_dir, args.tokens, tmp)}
    mib = 2**20
    fig: dict = {"bench": "long_context", "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden}
    for sp, ranks in res.items():
        peak = max(r["peak_bytes"] for r in ranks)
        secs = max(r["seconds"] for r in ranks)
        fig[f"sp{sp}"] = {"peak_mib_per_rank": [round(r["peak_bytes"] / mib, 1) for r in ranks],
                          "update_s": round(secs, 2), "tokens_per_s": round(args.tokens / secs, 1),
                          "tokens_per_s_per_rank": round(args.tokens / secs / sp, 1), "loss": ranks[0]["loss"]}
        print(f"sp={sp}: peak activation memory per rank {peak / mib:8.1f} MiB   update {secs:6.2f} s   "
              f"{args.tokens / secs:7.1f} tokens/s ({args.tokens / secs / sp:7.1f} per rank)   loss {ranks[0]['loss']:.6f}")
    fig["memory_ratio_sp2_over_sp1"] = round(max(r["peak_bytes"] for r in res[2]) / res[1][0]["peak_bytes"], 3)
    fig["tokens_per_s_ratio_sp2_over_sp1"] = round(res[1][0]["seconds"] / max(r["seconds"] for r in res[2]), 3)
    print(f"peak per rank sp2/sp1 = {fig['memory_ratio_sp2_over_sp1']}, "
          f"tokens/s sp2/sp1 = {fig['tokens_per_s_ratio_sp2_over_sp1']}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
