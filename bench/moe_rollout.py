"""Expert-parallel rollout (``rollout.ep``) vs replicas holding every expert: sampling on 4 processes.

The small Qwen3-MoE of ``bench/moe.py`` (hidden 256, 4 layers, 16 experts top-2) is sampled by 4 rollout
replicas (``rollout.tp = 1``), each with its own ``--prompts / 4`` prompts, in two layouts, each in one
4-process gloo launch: ``ep1`` (every replica holds all 16 experts) and ``ep4`` (each holds 4; the routed
rows go to their owners by all-to-all, ``rlhf.rollout.expert_dispatch``). Per layout: the wall time of
``Sampler.generate`` (greedy, ``--new`` tokens, slowest replica, after one warm-up), generated tokens/s over
all replicas, and per rank the expert weights' bytes and the peak resident-set growth during generation
(about 0 on CPU: the KV cache is allocated by the warm-up).

Run::

    python bench/moe_rollout.py
    python bench/moe_rollout.py --prompts 32 --new 64 --rounds 2
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.moe import PeakRSS, launch_four, write_model  # noqa: E402


def child(rank: int, world: int, store_path: str, path: str, ep: int, args, out: str) -> None:
    import transformers

    from rlhf.rollout import Sampler, SamplingParams
    from rlhf.rollout.reshard import RolloutLayout, rollout_slice

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    lay = RolloutLayout.build(1, "cpu", ep=ep)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    weights = {n: rollout_slice(p.detach(), n, 0, 1, model.config, lay.ep_rank, lay.ep).clone()
               for n, p in model.named_parameters()}
    expert_bytes = sum(t.numel() * t.element_size() for n, t in weights.items() if ".experts." in n)
    sampler = Sampler(model.config, weights, pad_token_id=0, ep_group=lay.ep_group, max_num_seqs=args.prompts)
    del model
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(2, 2048, (args.prompt,), generator=g).tolist() for _ in range(args.prompts // world)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new, stop_token_ids=[])
    sampler.generate(prompts, params)  # warm-up
    dist.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        gen = sampler.generate(prompts, params)
        dist.barrier()
        wall = time.perf_counter() - t0
    tokens = torch.tensor([int(gen.response_mask.sum()), mem.peak - mem.base, expert_bytes])
    every = [torch.zeros_like(tokens) for _ in range(world)]
    dist.all_gather(every, tokens)
    if rank == 0:
        total = sum(int(t[0]) for t in every)
        Path(out).write_text(json.dumps({
            "layout": f"ep{ep}", "generate_s": round(wall, 3), "tokens": total, "tokens_per_s": round(total / wall, 1),
            "peak_rss_growth_mib_per_rank": [round(int(t[1]) / 2**20, 1) for t in every],
            "expert_weights_mib_per_rank": [round(int(t[2]) / 2**20, 2) for t in every]}))
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="global prompts (divisible by 4)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="generated tokens per prompt")
    ap.add_argument("--rounds", type=int, default=1, help="launches per layout, alternating (load drift)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        path = write_model(os.path.join(d, "model"))
        for r in range(args.rounds):
            res = {ep: launch_four(child, d, path, ep, args, str(r)) for ep in (1, 4)}
            ratio = res[4]["tokens_per_s"] / res[1]["tokens_per_s"]
            mem = max(res[4]["expert_weights_mib_per_rank"]) / max(res[1]["expert_weights_mib_per_rank"])
            print(f"round {r}: ep4 / ep1 tokens/s x{ratio:.2f}, expert weights per rank x{mem:.2f}, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
