"""Operations: a hanging reward function costs its timeout, not the job; a stopped or stuck
rank ends the job with a line naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.reliability import kill_rank_after_checkpoint, stop_rank_and_wait
from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import ROOT, grpo_args, run_script, train_steps

# Hangs forever on every sample of prompts whose index is a multiple of 8; the reference
# reward scores those samples 0 instead, which is what a timed-out sample scores.
HANGING_REWARD = '''
import time

def reward(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 8 == 0:
        if HANG:
            time.sleep(3600)
        return 0.0
    return float(len(solution_str) % 2)
'''


def test_hanging_reward_times_out_is_counted_and_the_run_matches_a_zero_score(tiny_assets, tmp_path):
    runs = {}
    for hang in (True, False):
        f = tmp_path / f"reward_{hang}.py"
        f.write_text(f"HANG = {hang}\n" + HANGING_REWARD)
        out = tmp_path / f"run_{hang}"
        r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
            "reward.reward_fn": f"{f}:reward", "reward.timeout_s": 2, "reward.num_workers": 2,
            "data.val_files": "", "trainer.total_training_steps": 2}), nproc=2, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[hang] = train_steps(out / "metrics.jsonl")
    hung, ref = runs[True], runs[False]
    assert sorted(hung) == sorted(ref) == [1, 2]
    assert sum(m["reward/timeouts"] for m in hung.values()) > 0
    assert all(m["reward/timeouts"] == 0 and m["reward/errors"] == 0 for m in ref.values())
    for step in hung:
        for key in ("reward/score_mean", "actor/loss", "actor/entropy", "response_length/mean"):
            assert abs(hung[step][key] - ref[step][key]) <= 1e-6, (step, key, hung[step][key], ref[step][key])


def _start(args, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_grpo.py")] + args
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(out: Path, step: int, proc, limit: float = 240) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if (out / "metrics.jsonl").exists() and any(m.get("step", 0) >= step and "actor/loss" in m
                                                     for m in read_metrics(out / "metrics.jsonl")):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} after {limit} s")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds worker pids through /proc")
def test_sigstopped_rank_ends_the_job_with_a_line_naming_it(tiny_assets, tmp_path):
    out = tmp_path / "run"
    proc = _start(grpo_args(tiny_assets, out, **{"data.val_files": "", "trainer.total_training_steps": 500,
                                                 "trainer.heartbeat_timeout_s": 4,
                                                 "trainer.collective_timeout_s": 120}), out)
    try:
        _wait_for_step(out, 1, proc)
    except BaseException:
        proc.kill()
        raise
    pid, text, gone = stop_rank_and_wait(proc, 1)
    assert proc.returncode != 0
    assert "[rlhf] watchdog: rank 1 stopped responding (last seen in phase" in text, text[-3000:]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    print(f"SIGSTOP of rank 1 -> every process gone after {gone:.1f} s (heartbeat_timeout_s=4)")


def test_rank_stuck_outside_a_collective_is_named(tiny_assets, tmp_path):
    f = tmp_path / "stuck_reward.py"
    f.write_text("import os, time\n\ndef reward(ds, s, gt, extra=None):\n"
                 "    if os.environ.get('RANK') == '1':\n        time.sleep(3600)\n    return 1.0\n")
    t0 = time.monotonic()
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "run", **{
        "reward.reward_fn": f"{f}:reward", "reward.num_workers": 0, "data.val_files": "",
        "trainer.heartbeat_timeout_s": 2, "trainer.collective_timeout_s": 20}), nproc=2, timeout=240)
    assert r.returncode != 0
    assert "[rlhf] watchdog: rank 1 is stuck in phase 'reward_fn' of step 1" in r.stderr, r.stderr[-3000:]
    print(f"rank stuck in its reward function -> job ended after {time.monotonic() - t0:.1f} s")


def _local_sh(tiny_assets, out, restarts: int, extra_env=None, **over):
    args = grpo_args(tiny_assets, out, **{"data.val_files": "", "trainer.total_training_steps": 4,
                                          "checkpoint.save_freq": 2, **over})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NPROC="2", MAX_RESTARTS=str(restarts),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **(extra_env or {}))
    return subprocess.Popen(["bash", str(ROOT / "launch" / "local.sh"), "configs/quickstart.yaml", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tiny_assets, tmp_path_factory) -> dict:
    """The 4 steps of launch/local.sh that the restarted runs below must reproduce: {step: metrics}."""
    out = tmp_path_factory.mktemp("uninterrupted")
    ref = _local_sh(tiny_assets, out, restarts=0)
    text, _ = ref.communicate(timeout=400)
    assert ref.returncode == 0, text[-3000:]
    return train_steps(out / "metrics.jsonl")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds worker pids through /proc")
def test_killed_rank_restarts_and_the_run_equals_an_uninterrupted_one(tiny_assets, tmp_path, uninterrupted):
    out = tmp_path / "killed"
    proc = _local_sh(tiny_assets, out, restarts=1)
    # torchrun's agent is local.sh's exec'd process, so the workers are its children.
    text = kill_rank_after_checkpoint(proc, out / "checkpoints" / "global_step_2", rank=1)
    assert proc.returncode == 0, text[-3000:]
    assert "resumed from" in text, text[-3000:]
    a, b = uninterrupted, train_steps(out / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        for key in ("data/batch_fingerprint", "actor/loss", "actor/grad_norm", "reward/score_mean", "actor/entropy"):
            assert abs(a[step][key] - b[step][key]) <= 1e-5 * max(1.0, abs(a[step][key])), (step, key)


def test_out_of_memory_halves_the_phase_budget_restarts_and_matches_an_uninterrupted_run(tiny_assets, tmp_path,
                                                                                       uninterrupted):
    oom = tmp_path / "oom"
    # A real torch.OutOfMemoryError entering the update of step 3 on rank 0, first attempt only.
    proc = _local_sh(tiny_assets, oom, 1, extra_env={"RLHF_TEST_OOM": "update:3"},
                     **{"checkpoint.save_freq": 1, "actor.ppo_micro_batch_size_per_gpu": 4})
    text, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, text[-3000:]
    assert "rank 0 ran out of memory in phase 'update' of step 3" in text, text[-3000:]
    assert "resumed from" in text and "at step 2" in text
    a, b = uninterrupted, train_steps(oom / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [b[s]["oom/retries"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    # Steps 3-4 ran with half the micro-batch (2 instead of 4): that changes summation order only.
    for step in a:
        for key in ("data/batch_fingerprint", "actor/loss", "actor/grad_norm", "reward/score_mean", "actor/entropy"):
            assert abs(a[step][key] - b[step][key]) <= 1e-4 * max(1.0, abs(a[step][key])), (step, key)


def test_out_of_memory_in_validation_halves_the_sampler_budget_and_restarts(tiny_assets, tmp_path):
    out = tmp_path / "run"
    proc = _local_sh(tiny_assets, out, 1, extra_env={"RLHF_TEST_OOM": "validate:1"},
                     **{"trainer.total_training_steps": 2, "checkpoint.save_freq": 1, "trainer.test_freq": 1,
                        "data.val_files": tiny_assets / "data" / "val.parquet", "rollout.max_num_seqs": 64})
    text, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, text[-3000:]
    assert "rank 0 ran out of memory in phase 'validate' of step 1" in text and "rollout.max_num_seqs" in text
    rows = {m["step"]: m for m in read_metrics(out / "metrics.jsonl") if "val/acc" in m}
    assert sorted(rows) == [0, 1, 2] and rows[2]["oom/retries"] == 1.0 and rows[2]["timing/validate"] > 0
