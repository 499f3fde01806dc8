"""GRPO with tools end to end: 2 ranks, the calculator in worker processes, training and validation
rollouts with tool calls, tool-use metrics logged, sampler log-probs equal to the trainer's."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import grpo_args, run_script, train_steps

AGENT = ("agent/tool_calls_per_traj", "agent/turns_per_traj", "agent/observation_tokens_per_traj",
         "agent/tool_error_rate")


def _args(assets, out, **over):
    return grpo_args(assets, out, **{
        "model.path": assets / "tool_model", "data.max_response_length": 128, "rollout.n": 2,
        "rollout.multi_turn.enable": True, "rollout.multi_turn.tool_config_path": assets / "tools.yaml",
        "rollout.multi_turn.num_workers": 1, "reward.reward_fn": "gsm8k", "trainer.test_freq": 2,
        "actor.tis_imp_ratio_cap": 2.0, **over})


@pytest.fixture(scope="module")
def colocated(tool_assets, tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("tools_colocated")
    r = run_script("train_grpo.py", _args(tool_assets, out), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return train_steps(out / "metrics.jsonl")


def test_grpo_with_tools_runs_and_logs_tool_use(colocated):
    steps = colocated
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["agent/tool_calls_per_traj"] > 0.5 and row["agent/observation_tokens_per_traj"] > 5
        assert row["agent/turns_per_traj"] > 1
        assert row["agent/tool_errors/timeout"] == row["agent/tool_errors/crash"] == 0
        assert row["rollout/logprob_diff_max"] < 1e-3  # stitched trajectories: sampler = trainer
    assert steps[2]["val/agent/tool_calls_per_traj"] > 0.5


def test_one_step_off_with_tools_first_step_equals_colocated(tool_assets, colocated, tmp_path):
    """2 training + 2 rollout ranks: the rollout ranks run the tools; B_1 (theta_0, no lag) is colocated's
    step 1 exactly, tool-use metrics included (summed over the rollout role)."""
    r = run_script("train_grpo.py", _args(tool_assets, tmp_path, **{"trainer.mode": "one_step_off"}), nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    lagged = train_steps(tmp_path / "metrics.jsonl")
    assert sorted(lagged) == [1, 2]
    for key in AGENT + ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean"):
        a, b = colocated[1][key], lagged[1][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    assert lagged[2]["async/policy_lag"] == 1.0 and lagged[2]["agent/tool_calls_per_traj"] > 0.5
    assert lagged[2]["val/agent/tool_calls_per_traj"] > 0.5  # the training ranks validate with their own tools


def test_fully_async_with_tools_at_zero_staleness_equals_colocated(tool_assets, colocated, tmp_path):
    """2 training + 2 rollout ranks, staleness_threshold 0 and a sync every update (the synchronous
    algorithm): the rollout ranks stream tool trajectories (parked at each call, resumed with the
    observation) from their own tools, and every metric of every step equals colocated's (1e-6), the
    tool-use metrics (tallied per group, summed by the training leader) and validation included."""
    r = run_script("train_grpo.py", _args(tool_assets, tmp_path, **{
        "trainer.mode": "fully_async", "parallel.rollout_ranks": 2, "async_training.require_batches": 2,
        "async_training.staleness_threshold": 0, "async_training.trigger_parameter_sync_step": 1}), nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    streamed = train_steps(tmp_path / "metrics.jsonl")
    assert sorted(streamed) == sorted(colocated) == [1, 2]
    compared = 0
    for step, row in colocated.items():
        for key, value in row.items():
            if key.startswith(("timing/", "perf/", "rollout/", "reshard/", "async/", "step", "data/epoch_progress")) \
                    or not isinstance(value, (int, float)):
                continue
            assert abs(streamed[step][key] - value) <= 1e-6 * max(1.0, abs(value)), (step, key, value, streamed[step][key])
            compared += 1
        assert streamed[step]["async/staleness_max"] == 0.0
    assert compared > 40 and any(k.startswith("agent/") for k in colocated[1])
    assert streamed[1]["agent/tool_calls_per_traj"] > 0.5


def test_eval_cli_runs_the_agent_loop_with_tools(tool_assets, tmp_path):
    import json
    import os
    import re
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    def evaluate(out, *extra):
        args = ["--model", str(tool_assets / "tool_model"), "--data", str(tool_assets / "data" / "val.parquet"),
                "--max-new-tokens", "128", "--reward", "gsm8k", "--reward-workers", "0", "--out", str(out), *extra]
        return subprocess.run([sys.executable, "-m", "rlhf.eval", *args], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)

    r = evaluate(tmp_path / "tools", "--tool-config", str(tool_assets / "tools.yaml"), "--tool-workers", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "tools" / "summary.json").read_text())["summary"]
    use = summary["tool_use"]
    assert use["agent/tool_calls_per_traj"] > 0.5 and use["agent/turns_per_traj"] > 1
    assert use["agent/observation_tokens_per_traj"] > 0 and "agent/tool_calls_per_traj" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "tools" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    # the calculator ran: each call's expression comes back evaluated in the tool's turn
    calls = [re.search(r'"expression":"(\d+)\+(\d+)"}}</tool_call><tool_response>(\d+)<', row["response"])
             for row in rows]
    assert sum(c is not None for c in calls) >= 8
    assert all(int(c[1]) + int(c[2]) == int(c[3]) for c in calls if c is not None)
    # the same model without tools: no tool turns, no tool metrics
    r = evaluate(tmp_path / "plain")
    assert r.returncode == 0, r.stderr[-3000:]
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())["summary"]
    assert "tool_use" not in plain
    assert not any("<tool_response>" in json.loads(line)["response"]
                   for line in (tmp_path / "plain" / "generations.jsonl").read_text().splitlines())
    r = evaluate(tmp_path / "bad", "--tool-config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "error: --tool-config:" in r.stderr and "Traceback" not in r.stderr
