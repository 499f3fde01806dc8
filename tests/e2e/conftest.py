"""Tiny model + tiny task built once per test session (no downloads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._assets import write_tiny_assets

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    return write_tiny_assets(tmp_path_factory.mktemp("assets"), n_train=64, n_val=16, n_sft=64)


PARITY_REWARD = '''
def parity(data_source, solution_str, ground_truth, extra_info=None):
    # Varied rewards from a random model, so groups are informative and updates move.
    # "short" is a second reward component for gdpo.
    return {"score": float(len(solution_str) % 2), "acc": float(len(solution_str) % 2),
            "short": float(len(solution_str) < 12)}
'''


@pytest.fixture
def parity_reward(tmp_path) -> str:
    """`reward.reward_fn` value of a user reward file giving varied rewards."""
    f = tmp_path / "parity_reward.py"
    f.write_text(PARITY_REWARD)
    return f"{f}:parity"


def train_steps(path: Path) -> dict[int, dict]:
    """``{step: metrics row}`` of the training steps logged in a metrics.jsonl."""
    from rlhf.ops.metrics import read_metrics

    return {row["step"]: row for row in read_metrics(path) if "actor/loss" in row}


def run_script(script: str, args: list[str], *, nproc: int = 1, timeout: int = 300, cwd=None):
    """Run an entry script (plain python for 1 process, torchrun otherwise); returns CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / script)] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / script)] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or ROOT)


def run_script_many(script: str, cases: list[list[str]], *, timeout: int = 600) -> list:
    """``run_script(script, args)`` for each args list of ``cases`` (1 process each), in one interpreter
    (tests/e2e/_entry_driver.py): same return codes and output, one import of torch instead of one per case."""
    import json
    import tempfile
    from types import SimpleNamespace

    with tempfile.TemporaryDirectory() as tmp:
        spec, results = Path(tmp) / "cases.json", Path(tmp) / "results.json"
        spec.write_text(json.dumps({"script": str(ROOT / script), "cases": [[str(a) for a in c] for c in cases]}))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "_entry_driver.py"), str(spec), str(results)],
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        assert r.returncode == 0 and results.exists(), r.stderr[-3000:]
        return [SimpleNamespace(**row) for row in json.loads(results.read_text())]


def grpo_args(assets: Path, out: Path, **over) -> list[str]:
    base = {
        "model.path": assets / "model", "data.train_files": assets / "data" / "train.parquet",
        "data.val_files": assets / "data" / "val.parquet", "data.max_prompt_length": 16,
        "data.max_response_length": 12, "data.train_batch_size": 8, "rollout.n": 2,
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 4, "actor.lr": 1e-3,
        "trainer.device": "cpu", "trainer.output_dir": out, "trainer.total_training_steps": 2,
        "checkpoint.export_hf": False,
    }
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]
