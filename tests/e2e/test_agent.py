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
