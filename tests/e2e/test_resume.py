"""A run stopped after a checkpoint and restarted continues at the right step, same data order."""

from __future__ import annotations

from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import grpo_args, run_script, train_steps

KEYS = ["data/batch_fingerprint", "data/epoch", "actor/loss", "actor/entropy", "response_length/mean", "reward/mean"]


def test_resume_continues_same_step_and_data(tiny_assets, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    # 10 prompts per epoch of 8 -> 8 batches/epoch... use 4 steps so the data order matters.
    r = run_script("train_grpo.py", grpo_args(tiny_assets, full, **{"trainer.total_training_steps": 4,
                                                                   "checkpoint.save_freq": 2}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    # Same config, stopped one step after the step-2 checkpoint (step 3 is lost) ...
    r = run_script("train_grpo.py", grpo_args(tiny_assets, part, **{"trainer.total_training_steps": 4,
                                                                   "checkpoint.save_freq": 2,
                                                                   "trainer.stop_after_steps": 3}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (part / "checkpoints" / "global_step_2" / "COMPLETE").is_file()
    assert not (part / "checkpoints" / "global_step_4").exists()
    # ... and restarted: resume=auto picks global_step_2 and runs steps 3 and 4 again.
    r = run_script("train_grpo.py", grpo_args(tiny_assets, part, **{"trainer.total_training_steps": 4,
                                                                   "checkpoint.save_freq": 2}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
    a, b = train_steps(full / "metrics.jsonl"), train_steps(part / "metrics.jsonl")
    # Each step is logged once: the lost step 3 of the stopped run is dropped on resume.
    steps = [m["step"] for m in read_metrics(part / "metrics.jsonl") if "actor/loss" in m]
    assert steps == [1, 2, 3, 4]
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in KEYS:
            assert abs(a[step][key] - b[step][key]) <= 1e-5 * max(1.0, abs(a[step][key])), (step, key, a[step][key], b[step][key])
    # Different steps really see different data (the fingerprint is informative).
    assert a[3]["data/batch_fingerprint"] != a[4]["data/batch_fingerprint"]
