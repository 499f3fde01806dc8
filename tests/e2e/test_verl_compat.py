"""verl's published GSM8K PPO quickstart and GRPO example command lines dry-run unchanged.

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
    """A fixture's arguments as bash would pass them (quotes removed, $HOME expanded)."""
    lines = [line for line in (FIXTURES / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    return shlex.split("\n".join(lines).replace("\\\n", " ").replace("$HOME", str(home)))


@pytest.fixture(scope="module")
def verl_home(tmp_path_factory) -> Path:
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model

    home = tmp_path_factory.mktemp("home")
    data = home / "data" / "gsm8k"
    make_addition_task(data, n_train=1024, n_val=16, seed=0)  # the GRPO example takes 1024 prompts a step
    shutil.copy(data / "val.parquet", data / "test.parquet")
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2-7B-Instruct"):
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        write_tiny_model(str(repo / "snapshots" / "c0ffee"), hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, intermediate_size=64)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("c0ffee")
    return home


def _dry_run(fixture: str, home: Path) -> str:
    """``python train_ppo.py --dry-run <fixture's arguments>`` (verl's main_ppo); its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", HOME=str(home), HF_HUB_CACHE=str(home / "hub"), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "--dry-run", *verl_args(fixture, home)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=home)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "data.train_files: 1024/1024 rows loaded" in r.stdout
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
