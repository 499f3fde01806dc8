"""Efficiency figures, profiler traces, health alerts and sample generations from a 2-rank run."""

from __future__ import annotations

import json

from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import grpo_args, run_script, train_steps
from tests.unit.test_docs_reference import assert_documented


def test_profile_mfu_memory_alerts_and_generations(tiny_assets, tmp_path):
    out = tmp_path / "run"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
        "trainer.profile_steps": "[2]", "trainer.log_val_generations": 3, "trainer.test_freq": 1,
        "trainer.alerts": "{entropy_collapse: 100.0, logprob_diff: 1000.0}"}), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = train_steps(out / "metrics.jsonl")
    assert_documented(k for m in read_metrics(out / "metrics.jsonl") for k in m)  # docs/reference/metrics.txt
    for m in steps.values():
        assert 0 < m["perf/mfu/update"] < 1 and 0 < m["perf/mfu/generate"] < 1
        assert m["perf/max_memory_gb/update"] > 0.1 and m["perf/max_memory_gb/rollout"] > 0.1
        assert m["perf/tokens_per_s"] == 2 * m["perf/tokens_per_s_per_device"] > 0
        # Entropy (a few nats) is below the threshold of 100; log-prob mismatch is far below 1000.
        assert m["alerts/entropy_collapse"] == 1.0 and m["alerts/logprob_diff"] == 0.0
    assert "[rlhf] alert at step 1: actor/entropy" in r.stdout
    # One chrome trace per rank for step 2 only, with the phases labelled.
    traces = sorted(p.relative_to(out).as_posix() for p in (out / "profile").rglob("*.json"))
    assert traces == ["profile/step_2/rank0.json", "profile/step_2/rank1.json"]
    names = {e.get("name") for e in json.loads((out / traces[0]).read_text())["traceEvents"]}
    assert {"rollout", "reward_fn", "logprobs", "update"} <= names
    # Validation before training and after steps 1 and 2: 3 rows each, the same prompts each time.
    rows = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert set(rows[0]) == {"step", "key", "sample", "prompt", "response", "ground_truth", "score"}
    assert [row["key"] for row in rows[:3]] == [row["key"] for row in rows[3:6]] == sorted(row["key"] for row in rows[:3])
