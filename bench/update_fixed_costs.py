"""The update's fixed costs on the quickstart shape: FSDP2 per-block units vs one whole-model unit.

On 2 gloo ranks (CPU, one thread each, as ``launch/quickstart.sh``), the quickstart's tiny Qwen2
(hidden 128, 4 layers, 0.8M parameters) and one step's batch (32 prompts x n = 8 = 256 rows,
prompts <= 16 tokens, responses 4..32, two mini-batches of 64 rows per rank, micro-batch 128):
the old-log-prob pass and the PPO update (``PolicyWorker.compute_log_probs`` / ``update_policy``),
once per ``model.fsdp_unit`` in turn per repeat so that a noisy shared machine hits both alike.
Reports medians of wall seconds and of this rank's CPU seconds (less sensitive to other jobs on
the machine), FSDP2 all-gathers / reduce-scatters per update, and whether both units end with the
same parameters (they must: same maths, fewer and larger collectives).

Run:  python bench/update_fixed_costs.py [--repeats 7]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

UNITS = ("block", "model")


def quickstart_batch(vocab: int, rows: int = 256, n: int = 8, P: int = 16, R: int = 32, seed: int = 0):
    """A GRPO step's batch of the quickstart's shape (random tokens; only the shapes matter here)."""
    from rlhf.schema.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(8, P + 1, (rows,), generator=g)
    resp_len = torch.randint(4, R + 1, (rows,), generator=g)
    cols = torch.arange(P + R)
    attn = ((cols >= P - prompt_len[:, None]) & (cols < P + resp_len[:, None])).long()
    ids = torch.randint(3, vocab, (rows, P + R), generator=g) * attn
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, responses=ids[:, P:],
        response_mask=(torch.arange(R) < resp_len[:, None]).float(),
        index=torch.arange(rows // n).repeat_interleave(n), rollout_log_probs=-torch.rand(rows, R, generator=g) * 3,
        truncated=torch.zeros(rows, dtype=torch.bool), advantages=torch.randn(rows, R, generator=g))


def count_fsdp_collectives() -> dict[str, int]:
    """Counts FSDP2's all-gathers and reduce-scatters (wraps its default collective objects)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    counts = {"all_gather": 0, "reduce_scatter": 0}
    for cls, key in ((coll.DefaultAllGather, "all_gather"), (coll.DefaultReduceScatter, "reduce_scatter")):
        def counted(self, *args, _call=cls.__call__, _key=key, **kw):
            counts[_key] += 1
            return _call(self, *args, **kw)
        cls.__call__ = counted
    return counts


def join_gloo(rank: int, world: int, port: int) -> None:
    """This spawned process joins the local gloo group of ``world`` ranks, on one intra-op thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_two_ranks(worker_main, model: str, *args) -> dict:
    """``worker_main(rank, 2, port, model_dir, *args, out)`` on 2 spawned gloo ranks over ``model`` (default:
    a fresh quickstart-shaped tiny model); returns the JSON rank 0 wrote to ``out``."""
    from rlhf.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model or str(write_tiny_model(os.path.join(tmp, "m")))
        out = os.path.join(tmp, "out.json")
        port = 29500 + os.getpid() % 1000
        mp.spawn(worker_main, args=(2, port, model_dir, *args, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)


def worker_main(rank: int, world: int, port: int, model_dir: str, repeats: int, out: str) -> None:
    join_gloo(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    actor = ActorConfig(lr=1e-4, ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=128,
                        log_prob_micro_batch_size_per_gpu=128, loss_agg_mode="token-mean")
    workers = {}
    for unit in UNITS:
        torch.manual_seed(0)
        workers[unit] = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=True, fsdp_unit=unit), mesh,
                                     torch.device("cpu"), actor_cfg=actor, total_steps=100)
    batch = quickstart_batch(workers["block"].hf_config.vocab_size)
    rows = len(batch) // world
    local = batch.select(list(range(rank * rows, (rank + 1) * rows)))
    counts = count_fsdp_collectives()
    res = {u: {"logprobs_s": [], "update_s": [], "update_cpu_s": [], "collectives": None} for u in UNITS}
    for rep in range(repeats + 1):  # the first repeat warms up and is dropped
        for unit in UNITS if rep % 2 == 0 else UNITS[::-1]:
            w = workers[unit]
            dist.barrier()
            t0 = time.perf_counter()
            lp, _ = w.compute_log_probs(local, temperature=1.0, micro_batch_size=128)
            local.old_log_probs = lp
            t1, c1 = time.perf_counter(), time.process_time()
            counts.update(all_gather=0, reduce_scatter=0)
            w.update_policy(local, mini_batch_rows=rows // 2, temperature=1.0, max_response_length=32)
            t2, c2 = time.perf_counter(), time.process_time()
            if rep:
                r = res[unit]
                r["logprobs_s"].append(t1 - t0)
                r["update_s"].append(t2 - t1)
                r["update_cpu_s"].append(c2 - c1)
                r["collectives"] = dict(counts)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in
               zip(workers["block"].model.parameters(), workers["model"].model.parameters()))
    if rank == 0:
        summary = {u: {"logprobs_s": statistics.median(r["logprobs_s"]), "update_s": statistics.median(r["update_s"]),
                       "update_cpu_s": statistics.median(r["update_cpu_s"]), "collectives": r["collectives"]}
                   for u, r in res.items()}
        summary["same_parameters"] = same
        with open(out, "w") as f:
            json.dump(summary, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default="", help="HF model dir (default: a fresh quickstart-shaped tiny model)")
    args = ap.parse_args()
    summary = run_two_ranks(worker_main, args.model, args.repeats)
    with open("/proc/loadavg") as f:
        summary["loadavg"] = f.read().split()[:3]
    for unit in UNITS:
        s = summary[unit]
        print(f"fsdp_unit={unit:5s}  log-probs {s['logprobs_s']:.3f} s  update {s['update_s']:.3f} s "
              f"(cpu {s['update_cpu_s']:.3f} s)  collectives/update {s['collectives']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
