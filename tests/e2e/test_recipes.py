"""The shipped real-model recipes load, pass config validation and fit their target GPUs
according to the memory planner (config.json-only model directories: no weights needed)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import run_script_many


RECIPES = [
    ("train_grpo.py", "grpo_qwen2.5_0.5b_gsm8k.yaml", "Qwen2.5-0.5B", 8),
    ("train_ppo.py", "ppo_qwen2.5_0.5b_gsm8k.yaml", "Qwen2.5-0.5B", 8),
    ("train_grpo.py", "dapo_qwen2.5_7b_math.yaml", "Qwen2.5-7B", 32),
    ("train_grpo.py", "grpo_qwen3_30b_a3b.yaml", "Qwen3-30B-A3B", 8),
    ("train_grpo.py", "grpo_qwen3_235b_a22b.yaml", "Qwen3-235B-A22B", 32),
    ("train_grpo.py", "grpo_gpt_oss_20b.yaml", "gpt-oss-20b", 8),
]


def _args(config: str, model: str, world: int) -> list[str]:
    return ["--config", f"configs/{config}", f"model.path=configs/models/{model}", "--dry-run",
            "--world-size", str(world), "--plan-device", "cuda", "--device-memory", "80GiB"]


@pytest.fixture(scope="module")
def dry_runs() -> dict:
    """Each script's recipes dry-run in one interpreter: {(config): result}."""
    out = {}
    for script in sorted({r[0] for r in RECIPES}):
        mine = [r for r in RECIPES if r[0] == script]
        out.update(zip([r[1] for r in mine], run_script_many(script, [_args(*r[1:]) for r in mine])))
    return out


@pytest.mark.parametrize("script, config, model, world", RECIPES)
def test_recipe_plans_and_fits_80gib(dry_runs, script, config, model, world):
    r = dry_runs[config]
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"world {world} = dp" in r.stdout and "[plan] fits: peak" in r.stdout, r.stdout[-3000:]
