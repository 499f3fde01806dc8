"""Reshard (training layout -> rollout layout) cost per rank, against a naive full-state-dict sync.

What it measures, per model, in one torchrun job:

* ``step``: one RL step of the trainer's phases on a synthetic batch - reshard + generate
  (``RolloutEngine.generate``), old log-probs, one actor update - median of ``--repeats``;
* ``reshard``: this project's pass (``gather_rollout_weights``: DTensor redistribute per
  parameter, rollout-TP slicing, pp broadcast), median of ``--repeats``, with the bytes
  this rank received;
* ``naive``: the baseline many RL stacks start from - every rank materialises the full
  state dict (``get_model_state_dict(full_state_dict=True)``, plus an ``all_gather_object``
  over pp stages), median of ``--repeats``, with the bytes received.

Shares are of the measured step time (for the naive sync: of the step with the naive sync
in place of the reshard). Models: the quickstart tiny Qwen2 (``rlhf.models.tiny``) and a
~100M Qwen2-like config (hidden 768, 12 layers, 12 heads, 4 kv heads, intermediate 2048,
vocab 32000), random weights.

Run::

    torchrun --nproc_per_node=2 bench/reshard.py
    torchrun --nproc_per_node=4 bench/reshard.py --tp 2 --rollout-tp 2

The last line printed (rank 0) is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from rlhf.models.loading import load_tokenizer  # noqa: E402
from rlhf.models.tiny import write_tiny_model  # noqa: E402
from rlhf.rollout.engine import RolloutEngine  # noqa: E402
from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights  # noqa: E402
from rlhf.schema.batch import PromptBatch, RolloutBatch, minibatch_major_shard  # noqa: E402
from rlhf.schema.config import ActorConfig, ModelConfig, ParallelConfig, RolloutConfig  # noqa: E402
from rlhf.train.actor import PolicyWorker  # noqa: E402

MODELS = {
    "quickstart": {},  # rlhf.models.tiny defaults
    "qwen2_100m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                       vocab_size=32000),
    # Qwen2.5-0.5B's shape (random weights; tied embeddings as in tiny_qwen2_config)
    "qwen2.5_0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                         vocab_size=151936),
}


def _write_model(name: str, root: Path) -> str:
    out = root / name
    kw = dict(MODELS[name])
    vocab = kw.pop("vocab_size", None)
    if dist.get_rank() == 0:
        if vocab is None:
            write_tiny_model(str(out), **kw)
        else:  # a large vocab with the char tokenizer: decoding skips ids it does not know
            from transformers import Qwen2ForCausalLM

            from rlhf.data.char_tokenizer import build_char_tokenizer
            from rlhf.models.tiny import tiny_qwen2_config

            torch.manual_seed(0)
            tok = build_char_tokenizer()
            cfg = tiny_qwen2_config(vocab, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                    max_positions=512, **kw)
            Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
    dist.barrier()
    return str(out)


def _naive_full_state_dict(worker: PolicyWorker) -> tuple[float, int]:
    """Every rank gets the full state dict (the baseline). Returns (seconds, bytes received)."""
    t0 = time.perf_counter()
    local = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else 0
                for p in worker.model.parameters())
    sd = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True))
    unique = {t.data_ptr(): t for t in sd.values()}  # a tied embedding / head counts once
    received = sum(t.numel() * t.element_size() for t in unique.values()) - local
    if worker.pp_group is not None:
        parts = [None] * dist.get_world_size(worker.pp_group)
        dist.all_gather_object(parts, {k: v.cpu() for k, v in sd.items()}, group=worker.pp_group)
        own = set(sd)
        for part in parts:
            for k, v in part.items():
                if k not in own:
                    sd[k] = v
                    received += v.numel() * v.element_size()
    seconds = time.perf_counter() - t0
    del sd
    return seconds, received


def _batch(rollout: RolloutBatch, gen: torch.Generator) -> RolloutBatch:
    """The rollout with old log-probs and random advantages, ready for an update."""
    rollout.old_log_probs = rollout.rollout_log_probs.clone()
    rollout.advantages = torch.randn(rollout.responses.shape, generator=gen).to(rollout.responses.device)
    return rollout


class _PhasePeak:
    """Peak GPU memory allocated during each phase (``max_memory_allocated``, reset per phase)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.peaks: dict[str, int] = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self, phase: str) -> None:
        if self.cuda:
            self.peaks[phase] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()


def bench_model(name: str, root: Path, args, device: torch.device) -> dict:
    path = _write_model(name, root)
    world = dist.get_world_size()
    tp, pp = args.tp, args.pp
    dp = world // (tp * pp)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    mini = args.prompts  # one optimizer step per RL step
    actor_cfg = ActorConfig(lr=1e-5, ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=args.n * mini,
                            log_prob_micro_batch_size_per_gpu=args.n * mini)
    worker = PolicyWorker(ModelConfig(path=path), mesh, device, actor_cfg=actor_cfg, total_steps=100,
                          parallel_cfg=ParallelConfig(pp=pp, tp=tp, dp=dp, pp_microbatches=pp))
    tok = load_tokenizer(path)
    layout = RolloutLayout.build(args.rollout_tp, device.type)
    engine = RolloutEngine(RolloutConfig(n=args.n, tp=args.rollout_tp, seed=0), tok, max_prompt_length=16,
                           max_response_length=args.response_length, device=device, layout=layout)
    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(6, len(tok), (12,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = PromptBatch(prompt_ids=prompt_ids, keys=list(range(args.prompts)), ground_truths=[""] * args.prompts,
                          data_sources=["bench"] * args.prompts, extra_infos=[{}] * args.prompts)
    local_rows = minibatch_major_shard(list(range(args.prompts)), mesh["dp"].get_local_rank(), dp, mini)
    steps, reshards, reshard_bytes = [], [], []
    for rep in range(args.repeats + 1):  # the first step warms up allocators / lazy inits
        dist.barrier()
        t0 = time.perf_counter()
        mem = _PhasePeak(device)
        rollout, stats = engine.generate(worker.model, worker.hf_config, prompts, step=rep, n=args.n, temperature=1.0,
                                         local_rows=local_rows, pp_group=worker.pp_group)
        mem.mark("generate")
        batch = _batch(rollout, g)
        batch.old_log_probs, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=args.n * mini)
        mem.mark("log_probs")
        worker.update_policy(batch, mini_batch_rows=len(batch), temperature=1.0,
                             max_response_length=args.response_length)
        mem.mark("update")
        dist.barrier()
        if rep:
            steps.append(time.perf_counter() - t0)
            reshards.append(stats["timing/reshard"])
            reshard_bytes.append(stats["reshard/bytes_received"])
    alone, alone_bytes, naive, naive_bytes = [], 0, [], 0
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        weights, rs = gather_rollout_weights(worker.model, pp_group=worker.pp_group, tp_rank=layout.tp_rank,
                                             tp_size=layout.tp, tp_group=layout.tp_group)
        alone.append(time.perf_counter() - t0)
        alone_bytes = rs.bytes_received
        del weights
        dist.barrier()
        seconds, naive_bytes = _naive_full_state_dict(worker)
        naive.append(seconds)
    n_params = sum(p.numel() for p in worker.model.parameters())
    # Per-rank figures reduced to the maximum over ranks (the slowest rank sets the pace).
    med = torch.tensor([statistics.median(steps), statistics.median(reshards), statistics.median(alone),
                        statistics.median(naive), float(alone_bytes), float(naive_bytes)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    step_s, reshard_s, reshard_alone_s, naive_s, rbytes, nbytes = med.tolist()
    naive_step = step_s - reshard_s + naive_s
    del worker, engine
    return {
        "peak_mem_bytes_by_phase": mem.peaks, "params_of_this_stage": n_params, "step_s": step_s, "reshard_s": reshard_s, "reshard_alone_s": reshard_alone_s,
        "reshard_share_of_step": reshard_s / step_s, "reshard_bytes_per_rank": rbytes,
        "naive_s": naive_s, "naive_bytes_per_rank": nbytes, "naive_share_of_step": naive_s / naive_step,
        "speedup_vs_naive": naive_s / reshard_alone_s, "bytes_ratio_naive_over_reshard": nbytes / max(rbytes, 1.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="quickstart,qwen2_100m", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4, help="global prompts per step")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--response-length", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when visible")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/reshard.py: --device cuda but no CUDA device is visible")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    results = {"world": dist.get_world_size(), "tp": args.tp, "pp": args.pp, "rollout_tp": args.rollout_tp,
               "device": device.type, "prompts": args.prompts, "n": args.n, "response_length": args.response_length,
               "repeats": args.repeats, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]  # rank 0 writes the models; every rank reads them from its directory
        dist.broadcast_object_list(root, src=0)
        for name in args.models.split(","):
            r = bench_model(name, Path(root[0]), args, device)
            results["models"][name] = r
            if dist.get_rank() == 0:
                print(f"[bench] {name}: step {r['step_s']:.3f}s, reshard {r['reshard_s']:.4f}s "
                      f"({100 * r['reshard_share_of_step']:.1f}% of step, "
                      f"{r['reshard_bytes_per_rank'] / 1e6:.1f} MB/rank)"
                      f" | naive full state dict {r['naive_s']:.4f}s ({100 * r['naive_share_of_step']:.1f}%, "
                      f"{r['naive_bytes_per_rank'] / 1e6:.1f} MB/rank), speedup {r['speedup_vs_naive']:.2f}x",
                      flush=True)
        dist.barrier()
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
