"""Summarise the logs of launch/gpu_check.sh: one JSON object and a markdown table.

Usage: ``python bench/gpu_summary.py OUT_DIR [--tests-rc N]``. Reads the last JSON line of
``sampler.log``, ``sampler_graph.log``, ``train_step.log``, ``reshard.log`` and ``gpu_step.log`` in OUT_DIR (any
missing or failed bench is reported as such, not guessed) and the pytest tail of ``tests.log``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path


def last_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def sampler_rows(res: dict | None, case: str) -> dict[int, dict]:
    if not res:
        return {}
    model = next(iter(res["models"].values()))
    return {r["batch"]: r for r in model["cases"] if r["case"] == case}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tests-rc", type=int, default=None)
    a = ap.parse_args()
    d = a.out_dir
    s, g = last_json(d / "sampler.log"), last_json(d / "sampler_graph.log")
    t, r = last_json(d / "train_step.log"), last_json(d / "reshard.log")
    tests_tail = (d / "tests.log").read_text(errors="replace").strip().splitlines()[-1:] if (d / "tests.log").exists() else []
    dev = (s or g or {}).get("device", {})
    summary: dict = {"device": dev.get("name"), "driver": driver(), "torch": dev.get("torch"), "cuda": dev.get("cuda"),
                     "tests": tests_tail[0] if tests_tail else None, "tests_rc": a.tests_rc, "sampler": {}}
    eager, graph = sampler_rows(s, "equal"), sampler_rows(g, "equal")
    for b in sorted(set(eager) | set(graph)):
        e, c = eager.get(b, {}), graph.get(b, {})
        summary["sampler"][b] = {"ours_tok_s": e.get("ours_tok_s"), "ours_graph_tok_s": c.get("ours_tok_s"),
                                 "hf_tok_s": e.get("hf_tok_s") or c.get("hf_tok_s"), "ratio": e.get("ratio"),
                                 "ratio_graph": c.get("ratio"), "hbm_share": e.get("ours_frac_of_hbm"),
                                 "hbm_share_graph": c.get("ours_frac_of_hbm"), "peak_share": e.get("ours_frac_of_peak"),
                                 "peak_share_graph": c.get("ours_frac_of_peak")}
    uneven = sampler_rows(s, "uneven")
    summary["sampler_uneven_ratio"] = {b: row["ratio"] for b, row in uneven.items()}
    if t:
        summary["update"] = {k: t.get(k) for k in ("tokens_per_s_padded", "tokens_per_s_dynamic", "mfu_dynamic",
                                                   "peak_mem_bytes_update", "peak_mem_bytes_no_ac", "peak_mem_bytes_ac")}
    if r:
        m = next(iter(r["models"].values()))
        summary["reshard"] = {k: m.get(k) for k in ("step_s", "reshard_s", "reshard_share_of_step", "naive_s",
                                                   "speedup_vs_naive", "peak_mem_bytes_by_phase")}
    step = last_json(d / "gpu_step.log")
    if step:
        keys = ("decode_kernel", "packed_kernel", "decode_tok_s", "decode_roofline_fraction", "prefill_mfu",
                "update_mfu", "update_speedup_vs_sdpa", "logprob_max_diff_vs_sdpa", "generate_speedup_vs_hf")
        summary["gpu_step"] = {m["model"]: {k: m.get(k) for k in keys} for m in step["models"]}
    print(json.dumps(summary))

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    print(f"\n**{summary['device']}**, driver {summary['driver']}, torch {summary['torch']} (CUDA {summary['cuda']}); "
          f"Qwen2.5-0.5B shape, random weights, bf16. GPU tests: {summary['tests']}\n")
    print("| batch | ours tok/s (eager) | ours tok/s (CUDA graph) | HF generate tok/s | ratio eager / graph "
          "| HBM roofline share (eager / graph) | bf16 peak share (eager / graph) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, x in summary["sampler"].items():
        print(f"| {b} | {f(x['ours_tok_s'], '.0f')} | {f(x['ours_graph_tok_s'], '.0f')} | {f(x['hf_tok_s'], '.0f')} "
              f"| {f(x['ratio'], '.2f')} / {f(x['ratio_graph'], '.2f')} "
              f"| {f(x['hbm_share'], '.2f')} / {f(x['hbm_share_graph'], '.2f')} "
              f"| {f(x['peak_share'], '.3f')} / {f(x['peak_share_graph'], '.3f')} |")
    if t:
        u = summary["update"]
        mem = u["peak_mem_bytes_update"]
        print(f"\nUpdate (bf16 autocast, padding-free, dynamic micro-batches): {f(u['tokens_per_s_dynamic'], '.0f')} "
              f"tok/s, MFU {f(u['mfu_dynamic'], '.3f')}, peak memory {f(mem and mem / 2**30, '.1f')} GiB")
    if r:
        x = summary["reshard"]
        peaks = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in (x["peak_mem_bytes_by_phase"] or {}).items())
        print(f"\nRL step (generate + log-probs + update): {f(x['step_s'], '.2f')} s, reshard {f(x['reshard_s'], '.4f')} s "
              f"({f(x['reshard_share_of_step'] and 100 * x['reshard_share_of_step'], '.1f')}% of step), "
              f"naive full-state-dict sync {f(x['naive_s'], '.4f')} s; peak memory by phase: {peaks or 'n/a'}")

    for name, x in summary.get("gpu_step", {}).items():
        print(f"\nbench/gpu_step.py, {name} (GRPO 32 x 8, prompt 256, responses <= 1024): decode "
              f"[{x['decode_kernel']}] {f(x['decode_tok_s'], '.0f')} tok/s, HBM roofline "
              f"{f(x['decode_roofline_fraction'], '.2f')}; prefill MFU {f(x['prefill_mfu'], '.3f')}; update MFU "
              f"[{x['packed_kernel']}] {f(x['update_mfu'], '.3f')}; packed vs bucketed SDPA "
              f"{f(x['update_speedup_vs_sdpa'], '.2f')}x; generate vs HF {f(x['generate_speedup_vs_hf'], '.2f')}x")


if __name__ == "__main__":
    main()
