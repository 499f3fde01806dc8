"""Expert parallelism vs tensor-parallel-only experts: one actor update of a small Qwen3-MoE on 4 processes.

Layouts (each in its own fresh 4-process launch, so the memory figures do not carry over):

* ``tp4``: today's path without ep - experts split over ``tp = 4`` (``rlhf.models.tensor_parallel``),
  every token replicated over the tp ranks (each rank routes and runs all tokens through its experts,
  partial outputs all-reduced);
* ``ep4``: ``dp 4 x ep 4`` - each rank holds 1/4 of the experts whole and its own 1/4 of the tokens,
  which reach their experts by all-to-all (``rlhf.models.expert_parallel``); attention / dense data-parallel.

Per layout: the median wall time of ``PolicyWorker.update_policy`` over ``--steps`` (after one
warm-up) on the same global batch, global tokens/s, and per rank the resident bytes of the expert
weights and the peak resident-set growth during the updates (CPU: ``/proc/self/statm`` polled every
ms; CUDA: ``max_memory_allocated``). The ratio printed last is ep4 / tp4 tokens/s.

Run::

    python bench/moe.py                      # CPU, gloo
    python bench/moe.py --steps 5 --rows 32

Prints one JSON object per layout, then the ratio line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYOUTS = {"tp4": dict(dp=1, tp=4, ep=1), "ep4": dict(dp=4, tp=1, ep=4)}


def write_model(d: str) -> str:
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                      moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=1024, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(d, safe_serialization=True)
    return d


class PeakRSS:
    """Peak resident-set growth (bytes) of this process while active (CPU)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.stop = False
        self.t = threading.Thread(target=self._poll, daemon=True)
        self.t.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, self._rss())


def batch(rows: int, prompt: int, response: int, vocab: int):
    from rlhf.schema.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    L = prompt + response
    ids = torch.randint(2, vocab, (rows, L), generator=g)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones(rows, L, dtype=torch.long), responses=ids[:, prompt:],
                        response_mask=torch.ones(rows, response), index=torch.arange(rows),
                        rollout_log_probs=torch.zeros(rows, response), truncated=torch.zeros(rows, dtype=torch.bool),
                        advantages=torch.randn(rows, response, generator=g))


def child(rank: int, world: int, store_path: str, path: str, layout: str, args, out: str) -> None:
    from rlhf.models.parallel import ParallelDims
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    lay = LAYOUTS[layout]
    mesh = ParallelDims.resolve(lay["dp"], lay["tp"], 1, world, ep=lay["ep"]).build_mesh("cpu")
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    cfg = ActorConfig(lr=1e-5, ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.rows // dp,
                      grad_clip=1e9)
    worker = PolicyWorker(ModelConfig(path=path, use_remove_padding=True, mixed_precision=False), mesh,
                          torch.device("cpu"), actor_cfg=cfg, total_steps=args.steps + 1,
                          parallel_cfg=ParallelConfig(dp=lay["dp"], tp=lay["tp"], ep=lay["ep"]))
    full = batch(args.rows, args.prompt, args.response, worker.hf_config.vocab_size)
    local = full.select(minibatch_major_shard(list(range(args.rows)), dp_rank, dp, args.rows))
    local.old_log_probs, _ = worker.compute_log_probs(local, temperature=1.0, micro_batch_size=args.rows)
    expert_bytes = sum(p.to_local().numel() * p.element_size() for n, p in worker.model.named_parameters()
                       if "experts" in n)
    kw = dict(mini_batch_rows=args.rows // dp, temperature=1.0, max_response_length=args.response)
    worker.update_policy(local, **kw)  # warm-up
    times = []
    with PeakRSS() as mem:
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            worker.update_policy(local, **kw)
            dist.barrier()
            times.append(time.perf_counter() - t0)
    peaks = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([mem.peak - mem.base, expert_bytes]))
    if rank == 0:
        step = statistics.median(times)
        tokens = args.rows * (args.prompt + args.response)
        res = {"layout": layout, **lay, "step_s": round(step, 4), "tokens_per_s": round(tokens / step, 1),
               "peak_rss_growth_mib_per_rank": [round(int(p[0]) / 2**20, 1) for p in peaks],
               "expert_weights_mib_per_rank": [round(int(p[1]) / 2**20, 2) for p in peaks]}
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def launch_four(child, workdir: str, path: str, name: str, args, tag: str) -> dict:
    """``child(rank, 4, store, path, name, args, out)`` on 4 spawned processes; prints and returns the JSON
    rank 0 wrote (with the load average)."""
    out, store = os.path.join(workdir, f"{name}{tag}.json"), os.path.join(workdir, f"{name}{tag}.store")
    mp.spawn(child, args=(4, store, path, name, args, out), nprocs=4, join=True)
    res = json.loads(Path(out).read_text())
    print(json.dumps({**res, "load": os.getloadavg()[0]}), flush=True)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16, help="global rows per update (divisible by 4)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=1, help="launches per layout, alternating (load drift)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        path = write_model(os.path.join(d, "model"))
        for r in range(args.rounds):
            results = {layout: launch_four(child, d, path, layout, args, str(r)) for layout in LAYOUTS}
            ep, tp = results["ep4"], results["tp4"]
            ratio = ep["tokens_per_s"] / tp["tokens_per_s"]
            mem = max(ep["peak_rss_growth_mib_per_rank"]) / max(max(tp["peak_rss_growth_mib_per_rank"]), 1e-9)
            print(f"round {r}: ep4 / tp4 tokens/s x{ratio:.2f}, peak RSS growth per rank x{mem:.2f}, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
