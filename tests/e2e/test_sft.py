"""train_sft.py: LoRA trains only the adapters; --dry-run checks the model directory and the data,
not only the config (tests/unit/test_sft_config.py: settings SFT does not implement are refused)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import run_script
from tests.e2e.test_user_errors import _error_line


def sft_args(assets, out, **over) -> list[str]:
    base = {"model.path": assets / "model", "sft.train_files": assets / "data" / "sft.jsonl",
            "sft.train_batch_size": 16, "sft.micro_batch_size_per_gpu": 8, "sft.lr": 1e-2, "trainer.device": "cpu",
            "trainer.output_dir": out, "trainer.log_freq": 1}
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


def test_lora_sft_trains_only_the_adapters(tiny_assets, tmp_path):
    out = tmp_path / "sft"
    r = run_script("train_sft.py", sft_args(tiny_assets, out, **{"model.lora_rank": 4, "model.lora_alpha": 8,
                                                                  "model.enable_gradient_checkpointing": True,
                                                                  "model.param_offload": True}))
    assert r.returncode == 0, r.stderr[-3000:]
    adapter = json.loads((out / "hf_export" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
    base = load_file(tiny_assets / "model" / "model.safetensors")
    merged = load_file(out / "hf_export" / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    # Embeddings and norms are not adapted: unchanged. Every linear of the blocks moved by B A.
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)


@pytest.mark.parametrize("over, expect", [
    ({"model.path": "/no/such/model"}, "model.path: model directory not found: /no/such/model"),
    ({"sft.train_files": "/no/such.jsonl"}, "sft.train_files: file not found: /no/such.jsonl"),
])
def test_sft_dry_run_checks_model_and_data(tiny_assets, tmp_path, over, expect):
    assert expect in _error_line(run_script("train_sft.py", ["--dry-run"] + sft_args(tiny_assets, tmp_path, **over)))


def test_sft_on_one_and_two_ranks_gives_the_same_model(tiny_assets, tmp_path):
    """The loss is normalised by the step's global token count, so the data-parallel split (and the
    micro-batches it implies) leaves the trained weights equal up to float rounding."""
    weights = []
    for nproc in (1, 2):
        out = tmp_path / f"sft_{nproc}"
        r = run_script("train_sft.py", sft_args(tiny_assets, out, **{"sft.micro_batch_size_per_gpu": 4}), nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        weights.append(load_file(out / "hf_export" / "model.safetensors"))
    base = load_file(tiny_assets / "model" / "model.safetensors")
    assert any(not torch.equal(base[k], weights[0][k]) for k in base)  # it trained
    for k in weights[0]:
        assert torch.allclose(weights[0][k], weights[1][k], rtol=1e-4, atol=1e-5), k
