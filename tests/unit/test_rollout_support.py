"""A model the rollout sampler cannot run is refused from its config.json alone, in one line."""

from __future__ import annotations

import pytest
import transformers

from rlhf.models.loading import check_rollout_support
from rlhf.schema.config import ConfigError

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)


def _dir(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)  # config.json only: no weights are needed to decide
    return str(tmp_path)


@pytest.mark.parametrize("config, msg", [
    (transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1),
     "mamba's layers keep convolution / recurrent state"),
    (transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4),
     "BloomForCausalLM's attention does not go through transformers' AttentionInterface"),
    (transformers.BartConfig(vocab_size=64, d_model=32), "bart is an encoder-decoder model"),
])
def test_unsupported_model_is_one_config_error(tmp_path, config, msg):
    with pytest.raises(ConfigError, match="^model.path: rollout sampler") as e:
        check_rollout_support(_dir(tmp_path, config))
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("config, reason", [
    (transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4), "not one of the hand-ported fast families"),
    # a fast family with what the functional decoder refuses falls back to the generic path, naming why
    (transformers.LlamaConfig(**SMALL, hidden_act="gelu"), "hidden activation 'gelu' of llama is not supported"),
    (transformers.LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
])
def test_outside_the_fast_path_runs_generic(tmp_path, config, reason, capsys):
    where = check_rollout_support(_dir(tmp_path, config), max_seq_len=64, announce=True)
    assert where.path == "generic" and reason in where.reason
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "runs on the generic path" in line and reason in line


def test_generic_path_refuses_rollout_tp(tmp_path):
    with pytest.raises(ConfigError, match="^rollout.tp: 2 > 1 is not supported on the generic rollout path"):
        check_rollout_support(_dir(tmp_path, transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4)), rollout_tp=2)


def test_generic_path_refuses_fp8_rollout(tmp_path):
    with pytest.raises(ConfigError, match="^rollout.quantization: fp8 is not supported on the generic rollout path"):
        check_rollout_support(_dir(tmp_path, transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4)),
                              quantization="fp8")


def test_supported_models_pass(tmp_path):
    where = check_rollout_support(_dir(tmp_path / "q", transformers.Qwen2Config(**SMALL)), max_seq_len=4096)
    assert where.path == "fast"
    # sliding windows shorter than the sequence are supported (rlhf.models.arch)
    check_rollout_support(_dir(tmp_path / "m", transformers.MistralConfig(**SMALL, sliding_window=16)), max_seq_len=64)
