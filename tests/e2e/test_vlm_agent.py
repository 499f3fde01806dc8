"""GRPO with tools on image prompts end to end: a tiny Qwen2.5-VL fitted to call the calculator, 2 CPU
ranks, one of which holds only text prompts. The agent loop runs tool turns on rows whose prompts carry
images; the trainer takes the stitched trajectories (observation tokens masked out of the loss, M-RoPE
positions over the whole trajectory) with the rows' images, and its log-probs equal the sampler's at fp32
rounding (``rollout/logprob_diff_max``: a tool turn resumed at the wrong rotary positions, or a forward
without the images, is off by ~1)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import run_script, train_steps

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vlm_tool_run(tmp_path_factory):
    from tests._assets import write_tool_vlm_assets

    root = write_tool_vlm_assets(tmp_path_factory.mktemp("vlm_tools"))
    out = root / "out"
    args = {"model.path": root / "tool_vlm", "data.train_files": root / "train.parquet", "data.val_files": "",
            "data.shuffle": False, "data.max_prompt_length": 48, "data.max_response_length": 128,
            "data.train_batch_size": 4, "rollout.n": 2, "actor.ppo_mini_batch_size": 4,
            "actor.ppo_micro_batch_size_per_gpu": 4, "actor.lr": 1e-3, "trainer.device": "cpu",
            "trainer.output_dir": out, "trainer.total_training_steps": 2, "checkpoint.export_hf": False,
            "rollout.multi_turn.enable": True, "rollout.multi_turn.tool_config_path": root / "tools.yaml",
            "rollout.multi_turn.num_workers": 0, "reward.reward_fn": "gsm8k", "reward.num_workers": 0}
    r = run_script("train_grpo.py", [f"{k}={v}" for k, v in args.items()], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return train_steps(out / "metrics.jsonl")


def test_vlm_grpo_with_tools_on_image_prompts(vlm_tool_run):
    steps = vlm_tool_run
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["agent/tool_calls_per_traj"] > 0.5 and m["agent/observation_tokens_per_traj"] > 1, m
        assert m["agent/turns_per_traj"] > 1
        assert m["rollout/logprob_diff_max"] < 1e-4, m["rollout/logprob_diff_max"]
        assert m["actor/grad_norm"] > 0
