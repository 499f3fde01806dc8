"""Memory planner vs measured: peak resident memory of one GRPO step on CPU, per rank.

    python bench/memory_plan.py                 # 2 model sizes x (1 rank, 2 gloo ranks)

For each case a random Qwen2 of the given width is written, `torchrun` runs trainer
construction (load, FSDP2 sharding, optimizer) plus one full step (rollout, log-probs,
update) with a thread sampling /proc/self/statm, and the peak growth of resident memory
over the process's post-import baseline is compared with ``rlhf.planner``'s peak for the
same config on ``cpu``. Short sequences (16 + 32 tokens), so this checks the model-state
terms (parameters, gradients, AdamW, load, rollout copy, FSDP units), which dominate here;
activation and logit terms are small at these lengths.
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

SIZES = {"45M": dict(hidden_size=768, num_layers=6, intermediate_size=2048),
         "100M": dict(hidden_size=1024, num_layers=8, intermediate_size=2816)}


def overrides(workdir: Path) -> list[str]:
    return [f"model.path={workdir / 'model'}", f"data.train_files={workdir / 'data' / 'train.parquet'}",
            "data.val_files=", "data.max_prompt_length=16", "data.max_response_length=32", "data.train_batch_size=8",
            "rollout.n=2", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=16",
            "actor.log_prob_micro_batch_size_per_gpu=16", "trainer.device=cpu", "trainer.logger=[]",
            "trainer.total_training_steps=1", f"trainer.output_dir={workdir / 'run'}", "checkpoint.export_hf=false",
            "checkpoint.save_freq=-1"]


def child(workdir: Path, out: Path) -> None:
    import torch  # noqa: F401  (imports belong to the baseline)
    import torch.distributed as dist

    from bench.train_step import PeakRSS
    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    cfg = load_config(None, overrides(workdir))
    with PeakRSS() as mem:
        trainer = RLTrainer(cfg)
        trainer.train_step(1)
    rank = dist.get_rank()
    Path(f"{out}.rank{rank}").write_text(json.dumps({"growth": mem.growth, "base": mem.base}))


def run_case(size: str, world: int, tmp: Path) -> dict:
    from rlhf.config.load import load_config
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model
    from rlhf.planner import plan_from_config

    workdir = tmp / size
    if not (workdir / "model").exists():
        write_tiny_model(str(workdir / "model"), num_heads=8, num_kv_heads=4, **SIZES[size])
        make_addition_task(workdir / "data", n_train=64, n_val=8, n_sft=0, seed=0)
    out = tmp / f"{size}_w{world}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve()), "--child", str(workdir), str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=900)
    measured = [json.loads(Path(f"{out}.rank{r}").read_text())["growth"] for r in range(world)]
    plan = plan_from_config(load_config(None, overrides(workdir)), world_size=world, device="cpu")
    return {"model": size, "params_M": round(plan.shape.num_params() / 1e6, 1), "ranks": world,
            "planned_peak_MiB": round(plan.peak / 2 ** 20), "planned_phase": plan.peak_phase,
            "measured_peak_MiB": round(max(measured) / 2 ** 20),
            "measured_over_planned": round(max(measured) / plan.peak, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="45M,100M")
    ap.add_argument("--worlds", default="1,2")
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]))
        return
    with tempfile.TemporaryDirectory() as d:
        rows = [run_case(s, int(w), Path(d)) for s in args.sizes.split(",") for w in args.worlds.split(",")]
    print(json.dumps(rows, indent=1))
    print("| model | ranks | planned peak (phase) | measured peak | measured / planned |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} ({r['params_M']}M) | {r['ranks']} | {r['planned_peak_MiB']} MiB ({r['planned_phase']}) "
              f"| {r['measured_peak_MiB']} MiB | {r['measured_over_planned']} |")


if __name__ == "__main__":
    main()
