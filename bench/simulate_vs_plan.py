"""Memory planner vs simulation, per phase, for the recipe configs (differences over 15% flagged).

    python bench/simulate_vs_plan.py                       # every recipe below, one process each
    python bench/simulate_vs_plan.py --only dapo_7b         # one of them

Each recipe runs ``python -m rlhf.simulate`` (one rank of the recipe's world on a fake process
group, fake tensors; rlhf/simulate.py) in a fresh process and ``rlhf.planner.plan_memory`` for
the same config, device cuda, and prints both phase totals and their ratio. The planner is a
model of the program, the simulation runs it; a phase where they differ by more than 15% is a
bug in one of them (or a term one side leaves out: the critic is not simulated). The rollout
phase is compared whole: the simulation runs the sampler (rlhf/ops/sim_rollout.py). With
``model.param_offload`` (the MoE recipes) both sides leave the host-resident training state out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (config, model config dir, world, extra overrides): every recipe in configs/ whose model has a
# config.json under configs/models/ (the quickstart configs train a model the quickstart makes itself);
# a recipe whose config or model directory is not in this checkout is skipped and said so
RECIPES = {
    "grpo_0.5b": ("configs/grpo_qwen2.5_0.5b_gsm8k.yaml", "configs/models/Qwen2.5-0.5B", 8, []),
    "ppo_0.5b": ("configs/ppo_qwen2.5_0.5b_gsm8k.yaml", "configs/models/Qwen2.5-0.5B", 8, []),
    "dapo_7b": ("configs/dapo_qwen2.5_7b_math.yaml", "configs/models/Qwen2.5-7B", 64, []),
    "ulysses_7b_32k": ("configs/grpo_qwen2.5_7b_32k_ulysses.yaml", "configs/models/Qwen2.5-7B", 64, []),
    "grpo_72b": ("configs/grpo_qwen2.5_72b_8x8.yaml", "configs/models/Qwen2.5-72B", 64, []),
    "qwen3_30b_a3b": ("configs/grpo_qwen3_30b_a3b.yaml", "configs/models/Qwen3-30B-A3B", 8, []),
    "qwen3_235b_a22b": ("configs/grpo_qwen3_235b_a22b.yaml", "configs/models/Qwen3-235B-A22B", 32, []),
    "gpt_oss_20b": ("configs/grpo_gpt_oss_20b.yaml", "configs/models/gpt-oss-20b", 8, []),
}
# planner terms the simulation does not run
NOT_SIMULATED = ("critic (params+grads+adam)",)
GIB = 1024 ** 3


def run(name: str, sim_json: str | None = None) -> dict:
    from rlhf.config.load import load_config
    from rlhf.planner import ModelShape, plan_memory

    cfg_file, model, world, extra = RECIPES[name]
    if not (ROOT / cfg_file).exists() or not (ROOT / model / "config.json").exists():
        return {"recipe": name, "seconds": 0, "rows": [], "notes": [f"skipped: {cfg_file} or {model} not here"]}
    overrides = [f"model.path={model}", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    if sim_json:  # the output of an earlier `python -m rlhf.simulate ... --json` of this recipe
        stdout = Path(sim_json).read_text()
    else:
        out = subprocess.run([sys.executable, "-m", "rlhf.simulate", "--config", cfg_file, "--world", str(world),
                              "--json", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if out.returncode:
            raise RuntimeError(f"{name}: simulate failed: {out.stderr[-2000:]}")
        stdout = out.stdout
        if os.environ.get("SIM_SAVE_DIR"):  # keep the raw simulation for later --sim-json runs
            Path(os.environ["SIM_SAVE_DIR"], f"{name}.txt").write_text(stdout)
    seconds = time.perf_counter() - t0
    # with pp, one JSON line per stage: the plan is the worst stage's, so each phase's worst stage
    sims = [json.loads(line) for line in stdout.strip().splitlines() if line.startswith("{")]
    sim = {"peaks": {ph: max((s["peaks"][ph] for s in sims if ph in s["peaks"]), key=lambda p: p["total"])
                     for ph in sims[0]["peaks"]}, "notes": sims[0]["notes"]}
    cfg = load_config(str(ROOT / cfg_file), overrides)
    plan = plan_memory(ModelShape.from_model_dir(str(ROOT / model)), cfg, world_size=world, device="cuda",
                       flash_attn=True)
    rows = []
    for phase in ("rollout", "log-probs", "update"):
        planned = plan.phases.get(phase)
        if planned is None or phase not in sim["peaks"]:
            continue
        planned_total = sum(v for k, v in planned.items() if k not in NOT_SIMULATED)
        simulated = sim["peaks"][phase]["total"]
        ratio = simulated / planned_total if planned_total else float("nan")
        rows.append({"recipe": name, "world": world, "phase": phase, "planned_GiB": round(planned_total / GIB, 2),
                     "simulated_GiB": round(simulated / GIB, 2), "sim_over_plan": round(ratio, 3),
                     "flag": abs(ratio - 1) > 0.15})
    return {"recipe": name, "seconds": round(seconds, 1), "rows": rows, "notes": sim["notes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated subset of {', '.join(RECIPES)}")
    ap.add_argument("--sim-json", action="append", default=[], metavar="RECIPE=FILE",
                    help="use a saved `python -m rlhf.simulate --json` output for RECIPE instead of running it")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(RECIPES)
    saved = dict(item.split("=", 1) for item in args.sim_json)
    results = [run(n, saved.get(n)) for n in names]
    print("| recipe | world | phase | planned (GiB) | simulated (GiB) | sim / plan | >15% |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {r['recipe']} | {r['world']} | {r['phase']} | {r['planned_GiB']} | {r['simulated_GiB']} | "
                  f"{r['sim_over_plan']} | {'FLAG' if r['flag'] else ''} |")
    for res in results:
        print(f"{res['recipe']}: simulated in {res['seconds']} s; " + "; ".join(res["notes"]))
    print(json.dumps({"load": open("/proc/loadavg").read().split()[:3], "results": results}))


if __name__ == "__main__":
    main()
