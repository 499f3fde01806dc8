"""A model the rollout sampler cannot run is refused from its config.json alone, in one line."""

from __future__ import annotations

import pytest
import transformers

from rlhf.models.decoder import SUPPORTED_MODEL_TYPES
from rlhf.models.loading import check_rollout_support
from rlhf.schema.config import ConfigError

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)


def _dir(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)  # config.json only: no weights are needed to decide
    return str(tmp_path)


@pytest.mark.parametrize("config, max_len, msg", [
    (transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4), None,
     f"model.path: rollout sampler: model_type 'gpt2' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"),
    (transformers.LlamaConfig(**SMALL, hidden_act="gelu"), None, "hidden activation 'gelu' of llama is not supported"),
    (transformers.LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), None,
     "rope_type 'dynamic'"),
])
def test_unsupported_model_is_one_config_error(tmp_path, config, max_len, msg):
    with pytest.raises(ConfigError, match="^model.path: rollout sampler") as e:
        check_rollout_support(_dir(tmp_path, config), max_seq_len=max_len)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_supported_models_pass(tmp_path):
    check_rollout_support(_dir(tmp_path / "q", transformers.Qwen2Config(**SMALL)), max_seq_len=4096)
    # sliding windows shorter than the sequence are supported (rlhf.models.arch)
    check_rollout_support(_dir(tmp_path / "m", transformers.MistralConfig(**SMALL, sliding_window=16)), max_seq_len=64)
