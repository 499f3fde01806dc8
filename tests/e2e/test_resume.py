"""A run stopped after a checkpoint and restarted continues at the right step, same data order."""

from __future__ import annotations

import shutil

import pytest

from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import grpo_args, run_script, train_steps

KEYS = ["data/batch_fingerprint", "data/epoch", "actor/loss", "actor/entropy", "response_length/mean", "reward/mean"]


def a_val0(run) -> float:
    return next(m["val/acc"] for m in read_metrics(run / "metrics.jsonl") if m["step"] == 0 and "val/acc" in m)


@pytest.fixture(scope="module")
def full(tiny_assets, tmp_path_factory):
    """An uninterrupted 4-step run with a checkpoint every 2 steps (both tests compare with it)."""
    out = tmp_path_factory.mktemp("resume") / "full"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{"trainer.total_training_steps": 4,
                                                                  "checkpoint.save_freq": 2}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_resume_continues_same_step_and_data(tiny_assets, tmp_path, full):
    part = tmp_path / "part"
    # Same config, stopped after 3 steps: a checkpoint is saved at the stop (issue 33), off the save_freq grid ...
    r = run_script("train_grpo.py", grpo_args(tiny_assets, part, **{"trainer.total_training_steps": 4,
                                                                   "checkpoint.save_freq": 2,
                                                                   "trainer.stop_after_steps": 3}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (part / "checkpoints" / "global_step_2" / "COMPLETE").is_file()
    assert (part / "checkpoints" / "global_step_3" / "COMPLETE").is_file()
    assert not (part / "checkpoints" / "global_step_4").exists()
    # ... and restarted: resume=auto picks global_step_3 and runs step 4.
    r = run_script("train_grpo.py", grpo_args(tiny_assets, part, **{"trainer.total_training_steps": 4,
                                                                   "checkpoint.save_freq": 2}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 3" in r.stdout
    a, b = train_steps(full / "metrics.jsonl"), train_steps(part / "metrics.jsonl")
    # Each step is logged once.
    steps = [m["step"] for m in read_metrics(part / "metrics.jsonl") if "actor/loss" in m]
    assert steps == [1, 2, 3, 4]
    # The resumed run's summary still compares with the step-0 validation of the first process.
    summary = [m for m in read_metrics(part / "metrics.jsonl") if "summary/steps" in m]
    assert len(summary) == 1 and summary[0]["summary/val_acc_initial"] == a_val0(full)
    assert "summary/val_acc_gain" in summary[0] and "summary/val_acc_final" in summary[0]
    # A job restarted after its last checkpoint (e.g. killed during the final export) logs no second summary.
    before = read_metrics(full / "metrics.jsonl")
    r = run_script("train_grpo.py", grpo_args(tiny_assets, full, **{"trainer.total_training_steps": 4,
                                                                   "checkpoint.save_freq": 2}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    after = read_metrics(full / "metrics.jsonl")
    assert [m["step"] for m in after] == [m["step"] for m in before]
    assert len([m for m in after if "summary/steps" in m]) == 1
    assert {k: v for k, v in after[-1].items() if k != "time"} == {k: v for k, v in before[-1].items() if k != "time"}
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in KEYS:
            assert abs(a[step][key] - b[step][key]) <= 1e-5 * max(1.0, abs(a[step][key])), (step, key, a[step][key], b[step][key])
    # Different steps really see different data (the fingerprint is informative).
    assert a[3]["data/batch_fingerprint"] != a[4]["data/batch_fingerprint"]


def test_a_damaged_latest_checkpoint_resumes_from_the_previous_one(tiny_assets, tmp_path, full):
    """issue 33: a flipped byte in the latest checkpoint's shards; resume=auto passes it over with a
    warning naming it, resumes from the previous complete one and redoes the same steps."""
    out = tmp_path / "run"
    shutil.copytree(full, out)  # the finished 4-step run, moved: checkpoints hold no absolute path
    args = grpo_args(tiny_assets, out, **{"trainer.total_training_steps": 4, "checkpoint.save_freq": 2})
    first = train_steps(out / "metrics.jsonl")
    latest, previous = out / "checkpoints" / "global_step_4", out / "checkpoints" / "global_step_2"
    shard = sorted((latest / "model_optim").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = run_script("train_grpo.py", args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"warning: skipped damaged checkpoint(s) {latest}: {shard.relative_to(latest)} differs" in r.stderr
    assert f"resumed from {previous} at step 2" in r.stdout
    assert (previous / "COMPLETE").is_file()
    steps = [m["step"] for m in read_metrics(out / "metrics.jsonl") if "actor/loss" in m]
    assert steps == [1, 2, 3, 4]  # no row lost, none twice
    again = train_steps(out / "metrics.jsonl")
    for step in (3, 4):
        for key in KEYS:
            assert abs(first[step][key] - again[step][key]) <= 1e-5 * max(1.0, abs(first[step][key])), \
                (step, key, first[step][key], again[step][key])
    # The same output_dir resumed with another batch size: one line naming the checkpoint, nothing lost.
    rows, ckpts = (out / "metrics.jsonl").read_text(), sorted(p.name for p in (out / "checkpoints").iterdir())
    r = run_script("train_grpo.py", args + ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and f"checkpoint.resume: checkpoint {latest}: data loader state has batch_size=8 " \
                                  f"but this run has batch_size=16" in errors[0], errors
    assert (out / "metrics.jsonl").read_text() == rows
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ckpts
