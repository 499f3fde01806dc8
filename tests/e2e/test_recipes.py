"""The shipped real-model recipes load, pass config validation and fit their target GPUs
according to the memory planner (config.json-only model directories: no weights needed)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import run_script


@pytest.mark.parametrize("script, config, model, world", [
    ("train_grpo.py", "grpo_qwen2.5_0.5b_gsm8k.yaml", "Qwen2.5-0.5B", 8),
    ("train_ppo.py", "ppo_qwen2.5_0.5b_gsm8k.yaml", "Qwen2.5-0.5B", 8),
    ("train_grpo.py", "dapo_qwen2.5_7b_math.yaml", "Qwen2.5-7B", 32),
    ("train_grpo.py", "grpo_qwen3_30b_a3b.yaml", "Qwen3-30B-A3B", 8),
    ("train_grpo.py", "grpo_qwen3_235b_a22b.yaml", "Qwen3-235B-A22B", 32),
])
def test_recipe_plans_and_fits_80gib(script, config, model, world):
    r = run_script(script, ["--config", f"configs/{config}", f"model.path=configs/models/{model}", "--dry-run",
                            "--world-size", str(world), "--plan-device", "cuda", "--device-memory", "80GiB"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"world {world} = dp" in r.stdout and "[plan] fits: peak" in r.stdout, r.stdout[-3000:]
