"""trainer.mode one_step_off on 4 gloo ranks (2 training + 2 rollout): what the pipeline must keep.

* Step 1 has no lag (B_1 is generated with theta_0 by the rollout role), so it equals the
  colocated 2-rank run's step 1; from step 2 on the batches are one update stale, which
  the logged lag, IS weights and mismatch show.
* A rollout rank killed with SIGKILL after checkpoint 2: torchrun restarts the job, it
  resumes with the in-flight batch the checkpoint holds, and every step's metrics equal
  the uninterrupted run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.reliability import kill_rank_after_checkpoint
from tests.e2e.conftest import PARITY_REWARD, ROOT, grpo_args, run_script, train_steps

STEPS = 4
KEYS = ("data/batch_fingerprint", "actor/loss", "actor/grad_norm", "reward/mean", "actor/entropy",
        "response_length/mean")


def _args(assets: Path, out: Path, reward: str, **over) -> list[str]:
    return grpo_args(assets, out, **{"reward.reward_fn": reward, "data.val_files": "", "actor.tis_imp_ratio_cap": 2.0,
                                     "trainer.total_training_steps": STEPS, "checkpoint.save_freq": 2, **over})


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> str:
    f = tmp_path_factory.mktemp("reward") / "parity_reward.py"
    f.write_text(PARITY_REWARD)
    return f"{f}:parity"


@pytest.fixture(scope="module")
def async_run(tiny_assets, reward, tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("one_step_off")
    r = run_script("train_grpo.py", _args(tiny_assets, out, reward, **{"trainer.mode": "one_step_off"}), nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    return train_steps(out / "metrics.jsonl")


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a))


def test_first_step_equals_colocated_and_later_batches_are_one_update_stale(tiny_assets, reward, async_run, tmp_path):
    r = run_script("train_grpo.py", _args(tiny_assets, tmp_path, reward), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    sync, lagged = train_steps(tmp_path / "metrics.jsonl"), async_run
    assert sorted(lagged) == list(range(1, STEPS + 1))
    for key in KEYS:
        assert _close(sync[1][key], lagged[1][key]), (key, sync[1][key], lagged[1][key])
    assert [lagged[s]["async/policy_lag"] for s in sorted(lagged)] == [0.0] + [1.0] * (STEPS - 1)
    # Same prompts at step 2, sampled by theta_0 instead of theta_1: other responses.
    assert sync[2]["data/batch_fingerprint"] == lagged[2]["data/batch_fingerprint"]
    assert not _close(sync[2]["actor/loss"], lagged[2]["actor/loss"], 1e-3)
    # Step 1 trains on its own samples (IS weight 1); later the trainer's policy moved away from the sampler's.
    assert _close(lagged[1]["async/is_weight_max"], 1.0, 1e-4) and abs(lagged[1]["async/mismatch_kl"]) < 1e-5
    assert all(lagged[s]["async/is_weight_max"] > 1.0 + 1e-3 for s in range(2, STEPS + 1))
    assert all(lagged[s]["async/mismatch_kl"] > 0 for s in range(2, STEPS + 1))
    assert all(lagged[s]["async/weight_bytes"] > 0 for s in range(1, STEPS - 1))  # theta_s ships while s + 2 <= last


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds worker pids through /proc")
def test_killed_rollout_rank_resumes_with_the_in_flight_batch(tiny_assets, reward, async_run, tmp_path):
    args = _args(tiny_assets, tmp_path, reward, **{"trainer.mode": "one_step_off"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--max-restarts=1",
           str(ROOT / "train_grpo.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # rank 3 is a rollout rank: its partner's in-flight batch is in the checkpoint.
    text = kill_rank_after_checkpoint(proc, tmp_path / "checkpoints" / "global_step_2", rank=3)
    assert proc.returncode == 0, text[-3000:]
    assert "resumed from" in text and "at step 2" in text, text[-3000:]
    held = list((tmp_path / "checkpoints" / "global_step_2").glob("rank_state*.pt"))
    assert sorted(p.name for p in held) == ["rank_state0.pt", "rank_state1.pt"]  # the training ranks'
    resumed = train_steps(tmp_path / "metrics.jsonl")
    assert sorted(resumed) == sorted(async_run)
    for step in async_run:
        for key in KEYS + ("async/is_weight_mean",):
            assert _close(async_run[step][key], resumed[step][key]), (step, key)


def test_lora_ships_the_base_once_then_only_adapters(tiny_assets, reward, async_run, tmp_path):
    """1 training + 1 rollout rank: after the first transfer only adapters cross (fewer bytes than
    the full weights the non-LoRA run ships), and the rollout copy follows the trained adapters."""
    r = run_script("train_grpo.py", _args(tiny_assets, tmp_path, reward, **{
        "trainer.mode": "one_step_off", "model.lora_rank": 8, "model.lora_alpha": 16, "actor.lr": 2e-3,
        "trainer.total_training_steps": 3, "checkpoint.save_freq": -1}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    lora = train_steps(tmp_path / "metrics.jsonl")
    assert [lora[s]["async/policy_lag"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert 0 < lora[1]["async/weight_bytes"] < async_run[1]["async/weight_bytes"] / 2
    assert lora[1]["actor/grad_norm"] > 0 and lora[3]["async/is_weight_max"] > 1.0 + 1e-4


def test_slow_trainer_outlasting_the_collective_timeout_completes(tiny_assets, reward, tmp_path, monkeypatch):
    """1 training + 1 rollout rank, collective timeout 2 s, validation sleeping 4 s on the training
    rank: the rollout rank waits for theta_0 through model loading and the first validation - a
    designed wait, on the pair's own group (trainer.exchange_timeout_s), which the collective
    timeout no longer bounds (with exchange_timeout_s = 2 this run fails in that recv)."""
    args = _args(tiny_assets, tmp_path, reward, **{
        "trainer.mode": "one_step_off", "trainer.total_training_steps": 2, "checkpoint.save_freq": -1,
        "data.val_files": tiny_assets / "data" / "val.parquet", "trainer.collective_timeout_s": 2})
    monkeypatch.setenv("RLHF_TEST_SLOW_PHASES", "validate:4")
    r = run_script("train_grpo.py", args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = train_steps(tmp_path / "metrics.jsonl")
    assert sorted(steps) == [1, 2] and steps[2]["async/policy_lag"] == 1.0
