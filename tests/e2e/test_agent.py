"""GRPO with tools end to end: 2 ranks, the calculator in worker processes, training and validation
rollouts with tool calls, tool-use metrics logged, sampler log-probs equal to the trainer's."""

from __future__ import annotations

from tests.e2e.conftest import grpo_args, run_script, train_steps


def test_grpo_with_tools_runs_and_logs_tool_use(tool_assets, tmp_path):
    out = tmp_path / "run"
    args = grpo_args(tool_assets, out, **{
        "model.path": tool_assets / "tool_model", "data.max_response_length": 128, "rollout.n": 2,
        "rollout.multi_turn.enable": True, "rollout.multi_turn.tool_config_path": tool_assets / "tools.yaml",
        "rollout.multi_turn.num_workers": 1, "reward.reward_fn": "gsm8k", "trainer.test_freq": 2})
    r = run_script("train_grpo.py", args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = train_steps(out / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["agent/tool_calls_per_traj"] > 0.5 and row["agent/observation_tokens_per_traj"] > 5
        assert row["agent/turns_per_traj"] > 1
        assert row["agent/tool_errors/timeout"] == row["agent/tool_errors/crash"] == 0
        assert row["rollout/logprob_diff_max"] < 1e-3  # stitched trajectories: sampler = trainer
    assert steps[2]["val/agent/tool_calls_per_traj"] > 0.5


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
