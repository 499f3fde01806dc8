"""verl's published GSM8K PPO quickstart and GRPO example command lines (and its Qwen2.5-VL geo3k one)
dry-run unchanged.

The arguments are in tests/fixtures/*.args exactly as verl publishes them (paths included):
``$HOME/data/gsm8k/*.parquet`` is made to exist (the tiny addition task) and the hub names
``Qwen/...`` resolve from a fake Hugging Face cache whose snapshots hold the tiny model.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures"


def verl_args(name: str, home: Path) -> list[str]:
    """A fixture's arguments as bash would pass them (quotes removed, $HOME expanded; the multi-turn
    example's $PROJECT_DIR is the home, $CONFIG_PATH its examples/sglang_multiturn/config)."""
    lines = [line for line in (FIXTURES / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ").replace("$CONFIG_PATH", "$PROJECT_DIR/examples/sglang_multiturn/config")
    return shlex.split(text.replace("$PROJECT_DIR", str(home)).replace("$HOME", str(home)))


@pytest.fixture(scope="module")
def verl_home(tmp_path_factory) -> Path:
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model

    home = tmp_path_factory.mktemp("home")
    data = home / "data" / "gsm8k"
    make_addition_task(data, n_train=1024, n_val=16, seed=0)  # the GRPO example takes 1024 prompts a step
    shutil.copy(data / "val.parquet", data / "test.parquet")
    for f in ("train.parquet", "test.parquet"):  # as verl's multi-turn GSM8K data: the tool's per-sample kwargs
        _with_tools_kwargs(data / f)
    make_addition_task(home / "data" / "dapo", n_train=2048, n_val=16, seed=1)  # DAPO generates 1536 a batch
    shutil.copy(home / "data" / "dapo" / "train.parquet", home / "data" / "dapo" / "dapo-math-17k.parquet")
    shutil.copy(home / "data" / "dapo" / "val.parquet", home / "data" / "dapo" / "aime-2024.parquet")
    config = home / "examples" / "sglang_multiturn" / "config"
    (config / "tool_config").mkdir(parents=True)
    shutil.copy(FIXTURES / "verl_gsm8k_multiturn" / "gsm8k_multiturn_grpo.yaml", config)
    (config / "tool_config" / "gsm8k_tool_config.yaml").write_text(
        (FIXTURES / "verl_gsm8k_multiturn" / "gsm8k_tool_config.yaml").read_text().replace("$FIXTURES", str(FIXTURES)))
    # Qwen2.5-32B has 8 KV heads (the DAPO recipe's rollout tp 4 and sp 8 divide them); the others 2.
    # 32k positions, as the real models: verl's lengths (up to 20k in the DAPO recipe) must fit them.
    for name, heads in (("Qwen/Qwen2.5-0.5B-Instruct", 2), ("Qwen/Qwen2-7B-Instruct", 2),
                        ("Qwen/Qwen2.5-3B-Instruct", 2), ("Qwen/Qwen2.5-32B", 8)):
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        write_tiny_model(str(repo / "snapshots" / "c0ffee"), hidden_size=32, num_layers=2, num_heads=max(4, heads),
                         num_kv_heads=heads, intermediate_size=64, max_positions=32768)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("c0ffee")
    _geo3k_assets(home)
    return home


def _geo3k_assets(home: Path) -> None:
    """verl's geo3k example: image rows in verl's multimodal schema (the shapes task) and a tiny Qwen2.5-VL
    (heads 4, kv heads 2: the example's rollout tp 2 divides them) under Qwen/Qwen2.5-VL-7B-Instruct."""
    from rlhf.data.shapes import make_shapes_task
    from rlhf.models.tiny_vlm import write_tiny_vlm

    data = home / "data" / "geo3k"
    make_shapes_task(data, n_train=512, n_val=8, n_sft=0)  # the example takes 512 prompts a step
    shutil.copy(data / "val.parquet", data / "test.parquet")
    repo = home / "hub" / "models--Qwen--Qwen2.5-VL-7B-Instruct"
    write_tiny_vlm(str(repo / "snapshots" / "c0ffee"), max_positions=32768)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")


def _with_tools_kwargs(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    for row in rows:
        row["extra_info"] = {**row["extra_info"], "tools_kwargs": {"calc_gsm8k_reward": {
            "create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}}}
    pq.write_table(pa.Table.from_pylist(rows), path)


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", HOME=str(home), HF_HUB_CACHE=str(home / "hub"), PYTHONPATH=str(ROOT),
               WANDB_MODE="offline", WANDB_SILENT="true")
    return env


def _dry_run(fixture: str, home: Path, rows: int = 1024) -> str:
    """``python train_ppo.py --dry-run <fixture's arguments>`` (verl's main_ppo); its stdout."""
    r = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "--dry-run", *verl_args(fixture, home)],
                       capture_output=True, text=True, timeout=300, env=_env(home), cwd=home)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"data.train_files: {rows}/{rows} rows loaded" in r.stdout
    return r.stdout


def test_verl_ppo_quickstart_dry_runs(verl_home):
    args = verl_args("verl_ppo_gsm8k_quickstart.args", verl_home)
    assert "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct" in args and "trainer.logger=[console]" in args
    out = _dry_run("verl_ppo_gsm8k_quickstart.args", verl_home)
    assert "dry run OK: config, data and parallel layout are valid" in out
    assert "[verl] actor_rollout_ref.actor.optim.lr=1e-06 -> actor.lr=1e-06" in out
    assert "[verl] critic.model.path='Qwen/Qwen2.5-0.5B-Instruct' -> critic.model_path=" in out
    assert "snapshots/c0ffee (Hugging Face cache)" in out
    # verl's defaults for what the command leaves out: GAE with a critic whose mini-batch follows the actor's
    assert "algorithm.adv_estimator='gae'" in out and "critic.ppo_mini_batch_size=64 (follows" in out
    resolved = out.split("[rlhf] resolved config:", 1)[1]
    assert "adv_estimator: gae" in resolved and "ppo_mini_batch_size: 64" in resolved


def test_verl_grpo_example_dry_runs(verl_home):
    out = _dry_run("verl_grpo_gsm8k_qwen2_7b.args", verl_home)
    assert "[verl] actor_rollout_ref.rollout.name='vllm': accepted, no effect here" in out
    assert "[verl] actor_rollout_ref.rollout.tensor_model_parallel_size=2 -> rollout.tp=2" in out
    # trainer.n_gpus_per_node=8 from one python process: the plan is for 8 ranks, data checked
    assert "planning for 8; run it with torchrun --nnodes=1 --nproc_per_node=8" in out
    assert "[plan] layout: world 8 = dp 8 x tp 1 x pp 1, rollout.tp 2" in out
    assert "dry run OK: config and data are valid" in out


def test_verl_lora_example_dry_runs(verl_home):
    """Issue 39: the LoRA example (rollout tp 2 on trainer.n_gpus_per_node=2) dry-runs unchanged."""
    out = _dry_run("verl_grpo_lora_qwen2_5_3b.args", verl_home)
    assert "[verl] actor_rollout_ref.model.lora_rank=64 -> model.lora_rank=64" in out
    assert "rollout.tp 2" in out and "dry run OK" in out


def test_verl_dapo_recipe_dry_runs(verl_home):
    """Issue 39: the DAPO 32B recipe (16 nodes x 8) dry-runs with only its paths changed: overlong buffer
    under custom_reward_function, use_token_level_loss, reward_manager dapo, dropout overrides of 0."""
    out = _dry_run("verl_dapo_qwen2_5_32b.args", verl_home, rows=2048)
    for line in ("custom_reward_function.overlong_buffer.enable=True -> reward.overlong_buffer_enable=True",
                 "actor_rollout_ref.actor.use_token_level_loss=True -> actor.loss_agg_mode='token-mean'",
                 "reward_model.reward_manager='dapo' -> reward.reward_manager='dapo'",
                 "planning for 128; run it with torchrun --nnodes=16 --nproc_per_node=8"):
        assert line in out, line
    assert "dry run OK" in out


def test_verl_multiturn_example_dry_runs(verl_home):
    """Issue 39: verl's multi-turn GSM8K example with --config-path/--config-name and its tool yaml (the tool
    ported with per-sample kwargs) dry-runs unchanged."""
    out = _dry_run("verl_gsm8k_multiturn.args", verl_home)
    assert "[verl] actor_rollout_ref.rollout.multi_turn.enable=True -> rollout.multi_turn.enable=True" in out
    assert "[verl] actor_rollout_ref.rollout.over_sample_rate=0.1 -> rollout.over_sample_rate=0.1" in out  # issue 55
    assert "dry run OK" in out


def test_verl_geo3k_vlm_example_dry_runs(verl_home):
    """Issue 37: verl's Qwen2.5-VL geo3k GRPO example (images column, rollout tp 2 on 8 GPUs) dry-runs
    unchanged: the processor reads every row's image and the planner sizes the language model."""
    out = _dry_run("verl_grpo_geo3k_qwen2_5_vl_7b.args", verl_home, rows=512)
    assert "[verl] actor_rollout_ref.rollout.tensor_model_parallel_size=2 -> rollout.tp=2" in out
    assert "[verl] data.image_key='images' -> data.image_key='images'" in out
    assert "planning for 8; run it with torchrun --nnodes=1 --nproc_per_node=8" in out
    assert "dry run OK" in out


def _run_2_steps(fixture: str, home: Path, out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """The fixture's command under ``torchrun --nproc_per_node=2`` for 2 steps (verl's scripts end in $@:
    the extra arguments are what a user appends), small responses so that it runs on CPU."""
    args = verl_args(fixture, home) + ["trainer.total_training_steps=2", "trainer.val_before_train=False",
                                       "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]",
                                       "data.max_response_length=24", f"trainer.default_local_dir={out_dir}", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(ROOT / "train_ppo.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(home), cwd=home)


def test_verl_lora_example_runs_with_a_tp2_rollout(verl_home, tmp_path):
    """Issue 39 item 3: LoRA with verl's rollout tensor_model_parallel_size=2 runs 2 steps on 2 CPU ranks."""
    r = _run_2_steps("verl_grpo_lora_qwen2_5_3b.args", verl_home, tmp_path / "out")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    from rlhf.ops.metrics import read_metrics

    rows = [m for m in read_metrics(tmp_path / "out" / "metrics.jsonl") if "timing/step" in m]
    assert len(rows) == 2  # metrics.jsonl although the command lists only its loggers


STEP_REWARD_FN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    import json, os
    with open(os.environ["STEP_REWARDS_LOG"], "a") as f:
        f.write(json.dumps(extra_info.get("tool_rewards")) + "\\n")
    return 0.0
"""


def test_verl_multiturn_example_runs_with_per_sample_tool_kwargs(verl_home, tmp_path):
    """Issue 39 items 5, 9, issue 55: the multi-turn example (its rollout.over_sample_rate=0.1 included) runs
    2 steps on 2 CPU ranks (trainer.n_gpus_per_node appended: 2); the ported Gsm8kTool gets each prompt's
    ground truth and its step rewards reach the reward function's extra_info."""
    (tmp_path / "r.py").write_text(STEP_REWARD_FN)
    os.environ["STEP_REWARDS_LOG"] = str(tmp_path / "seen.jsonl")
    try:
        r = _run_2_steps("verl_gsm8k_multiturn.args", verl_home, tmp_path / "out", "trainer.n_gpus_per_node=2",
                         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                         "actor_rollout_ref.rollout.n=2", f"custom_reward_function.path={tmp_path / 'r.py'}")
    finally:
        del os.environ["STEP_REWARDS_LOG"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    # 2 steps x 8 prompts x 2 samples in training (step rewards attached), then the 16 validation prompts:
    # over_sample_rate=0.1 started 9 prompts a step, and only the 8 used ones were scored
    assert len(seen) == 2 * 8 * 2 + 16 and all(isinstance(s, list) for s in seen[:32])
    from rlhf.ops.metrics import read_metrics

    rows = [m for m in read_metrics(tmp_path / "out" / "metrics.jsonl") if "timing/step" in m]
    assert [m["rollout/over_sample_started"] for m in rows] == [9.0, 9.0]
    assert all(m["rollout/over_sample_returned"] >= 1 and "rollout/aborted" in m for m in rows)
