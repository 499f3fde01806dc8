"""trainer.mode fully_async end to end, 1 training + 2 rollout ranks (an unequal split).

A stopped rollout rank is named by the job-wide watchdog. One run serves four checks (a torchrun launch costs more than the steps):

* ``staleness_threshold`` 0 and ``trigger_parameter_sync_step`` 1 is the synchronous algorithm, so
  every metric of every step equals the colocated one-process run's (1e-6), while the groups stream
  in from two rollout replicas in whatever order they finish;
* both runs train LoRA adapters: the training rank pushes the frozen base once, then only the
  adapters, and each rollout rank merges them into the base it keeps (one_step_off's rule), so
  the rollout copy is colocated's merged copy exactly;
* the training rank is killed with SIGKILL after checkpoint 1 (the rollout ranks are then already
  generating batch 2 under theta_1): torchrun restarts the job, ``resume: auto`` continues at step 1,
  the groups in flight at the kill are generated again, and the run still equals the colocated one
  on every metric (the data fingerprint included): no prompt lost, none used twice, seeded order;
* the checkpoints' ledger of data-order positions trained on grows by exactly one batch per step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.reliability import kill_rank_after_checkpoint
from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import PARITY_REWARD, ROOT, grpo_args, run_script, train_steps

STEPS, B = 2, 8
# Not comparable: wall-clock figures, and what only one mode logs (the colocated sampler's and reshard's
# statistics; the rollout role's own).
SKIP = ("timing/", "perf/", "rollout/", "reshard/", "async/", "step", "data/epoch_progress")


def positions(state: dict) -> set[int]:
    """Data-order positions a fully_async checkpoint records as trained on."""
    return set(range(state["base"])) | set(state["consumed"])


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds worker pids through /proc")
def test_zero_staleness_equals_colocated_through_a_kill_and_resume(tiny_assets, tmp_path):
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    common = {"reward.reward_fn": f"{reward}:parity", "data.val_files": "", "trainer.total_training_steps": STEPS,
              "rollout.max_num_seqs": 3, "model.lora_rank": 8, "model.lora_alpha": 16, "actor.lr": 2e-3}
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "sync", **common))
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "async"
    args = grpo_args(tiny_assets, out, **common, **{
        "trainer.mode": "fully_async", "parallel.rollout_ranks": 2, "async_training.require_batches": 2,
        "async_training.staleness_threshold": 0, "async_training.trigger_parameter_sync_step": 1,
        "checkpoint.save_freq": 1, "checkpoint.max_to_keep": 0})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "--max-restarts=1",
           str(ROOT / "train_grpo.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = kill_rank_after_checkpoint(proc, out / "checkpoints" / "global_step_1", rank=0)
    assert proc.returncode == 0, text[-3000:]
    assert "resumed from" in text, text[-3000:]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl") if "actor/loss" in m] == list(range(1, STEPS + 1))

    sync, lagged = train_steps(tmp_path / "sync" / "metrics.jsonl"), train_steps(out / "metrics.jsonl")
    assert sorted(lagged) == sorted(sync) == list(range(1, STEPS + 1))
    compared = 0
    for step, row in sync.items():
        for key, value in row.items():
            if key.startswith(SKIP) or not isinstance(value, (int, float)):
                continue
            assert abs(lagged[step][key] - value) <= 1e-6 * max(1.0, abs(value)), (step, key, value, lagged[step][key])
            compared += 1
        a = lagged[step]
        assert a["async/staleness_max"] == 0.0 and a["async/samples_dropped"] == 0
        assert 0.0 <= a["async/trainer_idle_share"] <= 1.0 and 0.0 <= a["async/rollout_idle_share"] <= 1.0
    assert compared > 20 * STEPS  # losses, grad norms, rewards, lengths, advantages, data fingerprint, ...
    assert len({sync[s]["data/batch_fingerprint"] for s in sync}) == STEPS  # the fingerprint is informative
    assert sync[2]["actor/grad_norm"] > 0 and sync[1]["actor/loss"] != sync[2]["actor/loss"]
    # the push after update 1 carries the adapters alone: fewer bytes than the base (fp32 like the
    # rollout copy; the whole push would be the base plus these). Measured: 65536 of 90544.
    base = sum(f.stat().st_size for f in (tiny_assets / "model").glob("*.safetensors"))
    assert 0 < lagged[1]["async/weight_bytes"] < 0.8 * base, (lagged[1]["async/weight_bytes"], base)

    trained = [set()]
    for step in range(1, STEPS + 1):
        state = json.loads((out / "checkpoints" / f"global_step_{step}" / "trainer_state.json").read_text())
        trained.append(positions(state["fully_async"]))
        assert trained[-2] <= trained[-1] and len(trained[-1] - trained[-2]) == B, (step, trained)
    assert trained[-1] == set(range(STEPS * B))


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds worker pids through /proc")
def test_a_stopped_rollout_rank_ends_the_job_with_a_line_naming_it(tiny_assets, tmp_path):
    """SIGSTOP of rollout rank 2 after step 1: the job-wide watchdog (both roles) names it and every
    process is gone well within trainer.collective_timeout_s; the training rank, blocked waiting for
    groups, would otherwise wait trainer.exchange_timeout_s (hours)."""
    from bench.reliability import stop_rank_and_wait

    out, timeout_s = tmp_path / "run", 60
    args = grpo_args(tiny_assets, out, **{
        "data.val_files": "", "trainer.total_training_steps": 500, "trainer.mode": "fully_async",
        "parallel.rollout_ranks": 2, "async_training.require_batches": 2, "async_training.staleness_threshold": 0,
        "trainer.heartbeat_timeout_s": 4, "trainer.collective_timeout_s": timeout_s})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "train_grpo.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.monotonic()
        while not (out / "metrics.jsonl").exists() or not train_steps(out / "metrics.jsonl"):
            assert proc.poll() is None and time.monotonic() - t0 < 300, proc.stdout.read()[-3000:]
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        raise
    pid, text, gone = stop_rank_and_wait(proc, 2)
    assert proc.returncode != 0
    # named in the stream loop's own phase (published as the loop switches, not at the next beat)
    assert re.search(r"\[rlhf\] watchdog: rank 2 stopped responding \(last seen in phase "
                     r"'stream_(generate|wait_weights)' of step \d+", text), text[-3000:]
    assert gone < timeout_s, gone
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    print(f"SIGSTOP of rollout rank 2 -> every process gone after {gone:.1f} s (heartbeat_timeout_s=4)")
