"""SFT shares the model and parallel sections with RL: what it does not implement is refused in one
line at load time, never silently ignored."""

from __future__ import annotations

import pytest

from rlhf.config.load import load_config
from rlhf.schema.config import ConfigError
from rlhf.train.sft import SFTConfig, validate_sft

REQ = ["model.path=/m", "sft.train_files=/d.jsonl"]


@pytest.mark.parametrize("override", ["parallel.sp=2", "parallel.tp=2", "parallel.pp=2"])
def test_unimplemented_settings_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^config key '{key}': SFT runs data parallel only"):
        load_config(None, REQ + [override], cls=SFTConfig, check=validate_sft)


def test_settings_sft_implements_load():
    cfg = load_config(None, REQ + ["model.lora_rank=8", "model.param_offload=true", "parallel.dp=2",
                                   "model.enable_gradient_checkpointing=true", "trainer.logger=[console,mlflow]",
                                   "model.use_remove_padding=true"],
                      cls=SFTConfig, check=validate_sft)
    assert cfg.model.lora_rank == 8 and cfg.model.param_offload and cfg.model.use_remove_padding
    with pytest.raises(ConfigError, match="trainer.logger.*'wandbb'"):
        load_config(None, REQ + ["trainer.logger=[wandbb]"], cls=SFTConfig, check=validate_sft)
