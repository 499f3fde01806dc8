"""Simulated vs measured: one GRPO step of the ~100M model on 2 CPU / gloo ranks, per phase.

    python bench/simulate_vs_real.py                    # dp2, tp2, pp2
    python bench/simulate_vs_real.py --layouts tp2
    python bench/simulate_vs_real.py --device cuda --measured-only > m.json   # on a GPU: world 1
    python bench/simulate_vs_real.py --measured m.json                       # here: simulate and compare

For each layout a random Qwen2 of ~100M parameters (bench/memory_plan.py's "100M") is written,
``torchrun`` runs trainer construction and two steps (rollout, log-probs, update) on 2 gloo
ranks (glibc told to return freed blocks over 64 KiB at once, so the resident set follows the
live allocations), and the trainer's own per-phase peaks of the second step
(``perf/max_memory_gb/<phase>``: the resident set's high-water mark, reset at each phase start,
max over ranks; rlhf/ops/memory.py; AdamW's state exists by then, as in the simulation) are taken
as growth over the process's resident set just before the trainer is built. Then
``python -m rlhf.simulate`` runs every rank of the same config at world 2, device cpu (fake
process group, fake tensors) and its per-phase peaks (max over ranks) are compared:
``rollout`` with ``rollout``, ``logprobs`` with ``log-probs``, ``update`` with ``update``.

What the two count differently: the measured resident set also holds what is not a tensor the
simulation makes (shared-library pages first touched during the step, the Python objects of the
model, the tokenizer and data, glibc's free lists, gloo's buffers); the simulation counts live tensor
storages only, which is what an allocator's peak (``torch.cuda.max_memory_allocated`` on a GPU) counts.
So the child also measures that non-tensor part once, after the second step: the resident set's
growth less the growth of the tensors the garbage collector reaches (distinct storages), and each
row is also compared with the measured peak less it. Short sequences (16 + 32 tokens), so the model
state (parameters, AdamW, gradients, rollout copy, KV cache) dominates both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memory_plan import SIZES, overrides  # noqa: E402

# every row runs the update's backward, as in the simulation (whose fake advantages are not zero)
COMMON = ["actor.skip_zero_advantage_rows=false"]
LAYOUTS = {"dp2": [], "tp2": ["parallel.tp=2", "rollout.tp=2"],
           "pp2": ["parallel.pp=2", "model.use_remove_padding=false", "parallel.pp_microbatches=2"],
           # the GPU's long row on CPU (not in the default set): activations and the KV cache count
           "dp2-long": ["data.max_response_length=224", "rollout.n=4", "actor.ppo_micro_batch_size_per_gpu=8",
                        "actor.log_prob_micro_batch_size_per_gpu=8"]}
DEFAULT_LAYOUTS = ("dp2", "tp2", "pp2")
# one GPU (``--device cuda``): world 1, the allocator's own peak (torch.cuda.max_memory_allocated) against the
# simulation of a cuda rank (bf16 mixed precision); the long row makes activations and the KV cache count
CUDA_LAYOUTS = {"gpu1": [], "gpu1-long": ["data.max_response_length=224", "rollout.n=4",
                                          "actor.ppo_micro_batch_size_per_gpu=8",
                                          "actor.log_prob_micro_batch_size_per_gpu=8"]}
PHASES = {"rollout": "rollout", "log-probs": "logprobs", "update": "update"}
GIB = 1024 ** 3


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes() -> int:
    """Bytes of the distinct host storages of every tensor the garbage collector can reach (a DTensor's
    local shard), i.e. what the allocator holds for tensors between phases."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            t = o._local_tensor if isinstance(o, DTensor) else o
            if t.device.type == "cpu" and not t.is_meta:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def child(workdir: Path, out: Path, extra: list[str]) -> None:
    import torch  # (imports belong to the baseline)
    import torch.distributed as dist

    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    cuda = "trainer.device=cuda" in extra  # the allocator's counters: tensors only, none before the trainer
    base, tensors0 = (torch.cuda.memory_allocated(), 0) if cuda else (_resident(), _tensor_bytes())
    trainer = RLTrainer(load_config(None, [*overrides(workdir), "trainer.total_training_steps=2", *extra]))
    trainer.train_step(1)
    metrics = trainer.train_step(2)  # the second step: AdamW's state exists, as the simulation assumes
    # what the step's resident set holds that is no tensor (library pages first touched, Python objects,
    # gloo's buffers): the growth over the baseline less the tensors' growth, both after the step
    rest = 0 if cuda else (_resident() - base) - (_tensor_bytes() - tensors0)
    if dist.get_rank() == 0:
        peaks = {k.rsplit("/", 1)[1]: v * GIB - base for k, v in (metrics or {}).items()
                 if k.startswith("perf/max_memory_gb/")}
        from rlhf.models.varlen_attention import flash_attn_available

        out.write_text(json.dumps({"base": base, "growth": peaks, "not_tensors": rest,
                                   "flash_attn": cuda and flash_attn_available()}))


def simulated(workdir: Path, extra: list[str], world: int = 2, device: str = "cpu", flash: bool = True) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    sims = []
    for rank in range(world):
        p = subprocess.run([sys.executable, "-m", "rlhf.simulate", "--world", str(world), "--rank", str(rank),
                            "--device", device, "--json", *([] if flash else ["--no-flash-attn"]),
                            *overrides(workdir), *extra], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1800)
        if p.returncode:
            raise RuntimeError(p.stderr[-3000:])
        sims.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return {ph: max(s["peaks"][ph]["total"] for s in sims) for ph in PHASES}


def _workdir(tmp: Path) -> Path:
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model

    workdir = tmp / "100M"
    if not (workdir / "model").exists():
        write_tiny_model(str(workdir / "model"), num_heads=8, num_kv_heads=4, **SIZES["100M"])
        make_addition_task(workdir / "data", n_train=64, n_val=8, n_sft=0, seed=0)
    return workdir


def _layout(name: str, device: str) -> tuple[int, list[str]]:
    """(world, overrides) of one layout."""
    if device == "cuda":
        return 1, [*COMMON, "trainer.device=cuda", *CUDA_LAYOUTS[name]]
    return 2, [*COMMON, *LAYOUTS[name]]


def measure(name: str, tmp: Path, device: str = "cpu") -> dict:
    """The real run: per-phase peaks as growth over the baseline (``growth``) and its non-tensor bytes."""
    workdir, (world, extra) = _workdir(tmp), _layout(name, device)
    out = tmp / f"{name}.json"
    # glibc returns every freed block over 64 KiB to the kernel at once, so the resident set follows
    # the live allocations instead of keeping earlier phases' freed buffers on its free lists
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve()), "--child", str(workdir), str(out), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(out.read_text())


def compare(name: str, tmp: Path, real: dict, device: str = "cpu") -> dict:
    world, extra = _layout(name, device)
    measured, rest = real["growth"], real.get("not_tensors", 0)
    if device == "cuda":
        # the GPU's sampler took gpu_memory_utilization of a card with memory to spare: every slot full (its cap);
        # the simulation sizes an unbudgeted cache by the slots' need (as the planner), so it is given that budget
        from rlhf.config.load import load_config

        c = load_config(None, [*overrides(_workdir(tmp)), *extra])
        full = c.rollout.max_num_seqs * (c.data.max_prompt_length + c.data.max_response_length)
        extra = [*extra, f"rollout.kv_cache_tokens={full}"]
    # (the first H200 run's output has no "flash_attn": flash-attn was not installed there)
    sim = simulated(_workdir(tmp), extra, world, device, flash=real.get("flash_attn", False))
    rows = []
    for ph, real_ph in PHASES.items():
        m = measured.get(real_ph)
        rows.append({"layout": name, "phase": ph, "simulated_MiB": round(sim[ph] / 2 ** 20),
                     "measured_MiB": round(m / 2 ** 20) if m is not None else None,
                     "sim_over_measured": round(sim[ph] / m, 3) if m else None,
                     "measured_tensors_MiB": round((m - rest) / 2 ** 20) if m is not None else None,
                     "sim_over_tensors": round(sim[ph] / (m - rest), 3) if m else None})
    return {"layout": name, "rows": rows, "peak_sim_MiB": round(max(sim.values()) / 2 ** 20),
            "peak_measured_MiB": round(max(measured.get(p, 0) for p in PHASES.values()) / 2 ** 20),
            "not_tensors_MiB": round(rest / 2 ** 20)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default=None, help=f"default: {','.join(DEFAULT_LAYOUTS)} (also: dp2-long); "
                                                       f"with --device cuda {','.join(CUDA_LAYOUTS)}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--measured-only", action="store_true",
                    help="run the real side only and print its peaks as JSON (on a lent GPU, whose time is short)")
    ap.add_argument("--measured", help="a --measured-only JSON output: simulate those layouts and compare")
    args, extra = ap.parse_known_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), args.child[2:] + extra)
        return
    given = {}
    if args.measured:
        data = json.loads(Path(args.measured).read_text().strip().splitlines()[-1])
        # (an older output holds the growth alone)
        args.device, given = data["device"], {r["layout"]: r["measured"] if "growth" in r["measured"] else
                                              {"growth": r["measured"]} for r in data["results"]}
    names = (args.layouts or ",".join(given or (CUDA_LAYOUTS if args.device == "cuda" else DEFAULT_LAYOUTS))).split(",")
    with tempfile.TemporaryDirectory() as d:
        if args.measured_only:
            print(json.dumps({"device": args.device, "results": [
                {"layout": n, "measured": measure(n, Path(d), args.device)} for n in names]}))
            return
        results = [compare(n, Path(d), given.get(n) or measure(n, Path(d), args.device), args.device) for n in names]
    print("| layout | phase | simulated (MiB) | measured growth (MiB) | sim / measured | measured less "
          "non-tensor (MiB) | sim / that |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {r['layout']} | {r['phase']} | {r['simulated_MiB']} | {r['measured_MiB']} | "
                  f"{r['sim_over_measured']} | {r['measured_tensors_MiB']} | {r['sim_over_tensors']} |")
        print(f"| {res['layout']} | step peak | {res['peak_sim_MiB']} | {res['peak_measured_MiB']} | "
              f"{round(res['peak_sim_MiB'] / max(res['peak_measured_MiB'], 1), 3)} | "
              f"(non-tensor: {res['not_tensors_MiB']}) | |")
    print(json.dumps({"load": open("/proc/loadavg").read().split()[:3], "results": results}))


if __name__ == "__main__":
    main()
