"""Reliability figures: a reward that hangs on 1 sample in 50, and a SIGSTOPped rank.

    python bench/reliability.py [--steps 4] [--timeout-s 5]

1. Two 2-rank GRPO runs of the quickstart's shape (tiny random model, the synthetic addition
   task, 32 prompts x 8 samples per step) with the reward worker pool: one whose reward
   function returns at once, one whose reward sleeps forever on the responses with
   ``crc32(response) % 50 == 0`` (about 2%). Wall time of both, the timeouts counted.
2. A 2-rank run with the default ``trainer.heartbeat_timeout_s`` (60) and
   ``collective_timeout_s`` (600): rank 1 is sent SIGSTOP after its first step; the seconds
   until every process of the job is gone, and the line that names the rank.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REWARD = """
import time, zlib

def reward(data_source, solution_str, ground_truth, extra_info=None):
    if HANG and zlib.crc32(solution_str.encode()) % 50 == 0:
        time.sleep(3600)
    return float(len(solution_str) % 2)
"""


def args_for(workdir: Path, out: Path, steps: int, **over) -> list[str]:
    base = {"model.path": workdir / "model", "data.train_files": workdir / "data" / "train.parquet",
            "data.val_files": "", "data.max_prompt_length": 16, "data.max_response_length": 32,
            "data.train_batch_size": 32, "rollout.n": 8, "actor.ppo_mini_batch_size": 16,
            "actor.ppo_micro_batch_size_per_gpu": 128, "trainer.device": "cpu", "trainer.output_dir": out,
            "trainer.total_training_steps": steps, "checkpoint.save_freq": -1, "checkpoint.export_hf": False,
            "trainer.logger": "[jsonl]", **over}
    return [f"{k}={v}" for k, v in base.items()]


def popen(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_grpo.py"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def hang_run(workdir: Path, hang: bool, steps: int, timeout_s: float) -> dict:
    from rlhf.ops.metrics import read_metrics

    f = workdir / f"reward_{hang}.py"
    f.write_text(f"HANG = {hang}\n" + REWARD)
    out = workdir / f"run_{hang}"
    t0 = time.perf_counter()
    proc = popen(args_for(workdir, out, steps, **{"reward.reward_fn": f"{f}:reward", "reward.timeout_s": timeout_s}))
    text, _ = proc.communicate(timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"run failed:\n{text[-3000:]}")
    rows = [m for m in read_metrics(out / "metrics.jsonl") if "actor/loss" in m]
    last = rows[-1]
    return {"hang": hang, "wall_s": wall, "step_s": [m["timing/step"] for m in rows],
            "timeouts": sum(m["reward/timeouts"] for m in rows), "samples": 32 * 8 * steps,
            "last_step_perf": {k: v for k, v in last.items() if k.startswith(("perf/", "timing/"))}}


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (a child of the agent process), found through /proc."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (d / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == agent_pid and f"RANK={rank}".encode() in env:
                return int(d.name)
    return None


def kill_rank_after_checkpoint(proc: subprocess.Popen, checkpoint: Path, rank: int, timeout: float = 400) -> str:
    """Wait for ``checkpoint``/COMPLETE, SIGKILL torchrun's worker ``rank`` (``proc`` is the agent) and
    return the job's output once it ends (the agent restarts the workers when --max-restarts allows)."""
    try:
        t0 = time.monotonic()
        while not (checkpoint / "COMPLETE").exists():
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise AssertionError(f"no {checkpoint.name}:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.05)
        pid = worker_pid(proc.pid, rank)
        if pid is None:
            raise AssertionError(f"no worker with RANK={rank} under pid {proc.pid}")
        os.kill(pid, signal.SIGKILL)
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()


def stop_rank_and_wait(proc: subprocess.Popen, rank: int, timeout: float = 150) -> tuple[int, str, float]:
    """SIGSTOP torchrun's worker ``rank`` (``proc`` is the agent), wait for the job to end; returns the
    worker's pid, the job's output and the seconds from the stop to the end."""
    try:
        pid = worker_pid(proc.pid, rank)
        if pid is None:
            raise AssertionError(f"no worker with RANK={rank} under pid {proc.pid}")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        text, _ = proc.communicate(timeout=timeout)
        return pid, text, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()


def sigstop_run(workdir: Path) -> dict:
    out = workdir / "run_stop"
    proc = popen(args_for(workdir, out, 1000))
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
        if proc.poll() is not None:
            sys.exit(proc.stdout.read()[-3000:])
        time.sleep(0.2)
    pid = worker_pid(proc.pid, 1)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    text, _ = proc.communicate(timeout=1200)
    gone = time.perf_counter() - t0
    alive = True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        alive = False
    line = next((x for x in text.splitlines() if "watchdog:" in x), "")
    return {"seconds_until_all_gone": gone, "returncode": proc.returncode, "stopped_rank_alive": alive, "line": line}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--skip-sigstop", action="store_true")
    args = ap.parse_args()
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as d:
        workdir = Path(d)
        write_tiny_model(str(workdir / "model"), max_positions=64)
        make_addition_task(workdir / "data", n_train=512, n_val=8, n_sft=0, seed=0)
        normal = hang_run(workdir, False, args.steps, args.timeout_s)
        hung = hang_run(workdir, True, args.steps, args.timeout_s)
        stop = None if args.skip_sigstop else sigstop_run(workdir)
    extra = hung["wall_s"] - normal["wall_s"]
    print(f"reward hangs on ~1 in 50 samples, reward.timeout_s={args.timeout_s:g}, {args.steps} steps of "
          f"{32 * 8} samples: {hung['timeouts']:.0f} timeouts; wall {hung['wall_s']:.1f} s vs {normal['wall_s']:.1f} s "
          f"without hangs (+{extra:.1f} s = {extra / args.steps / args.timeout_s:.2f} x timeout_s per step)")
    perf = normal["last_step_perf"]
    print(f"last step without hangs: MFU update {perf['perf/mfu/update']:.3f}, generate {perf['perf/mfu/generate']:.4f} "
          f"(roof: measured CPU matmul FLOP/s), peak memory update {perf['perf/max_memory_gb/update']:.2f} GB, "
          f"{perf['perf/tokens_per_s_per_device']:.0f} tokens/s per device")
    if stop:
        print(f"SIGSTOP of rank 1 (defaults: heartbeat 60 s, collective 600 s): every process gone after "
              f"{stop['seconds_until_all_gone']:.1f} s, exit code {stop['returncode']}; {stop['line']}")
    print(json.dumps({"normal": normal, "hung": hung, "sigstop": stop}))


if __name__ == "__main__":
    main()
