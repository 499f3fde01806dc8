"""Every model_type transformers ships with a causal-LM head runs (fast or generic path) or is refused in one
line naming why (rlhf.models.generic.rollout_path); the docs table lists them all and agrees on a sample."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from rlhf.models.generic import classify, decoder_blocks, rollout_path

DOC = Path(__file__).resolve().parents[2] / "docs" / "howto" / "any-model.md"

SAMPLE = [
    ("llama", "fast", ""), ("qwen2", "fast", ""), ("deepseek_v3", "fast", ""),
    ("granite", "generic", "not one of the hand-ported fast families"), ("gpt2", "generic", ""),
    ("olmo3", "generic", ""), ("gemma4_text", "generic", ""),
    ("qwen3_5", "refused", "convolution / recurrent state"), ("qwen3_next", "refused", "convolution / recurrent state"),
    ("mamba", "refused", "convolution / recurrent state"),
    ("deepseek_v32", "refused", "indexed_attention layers"), ("llama4_text", "refused", "chunked_attention"),
    ("bart", "refused", "encoder-decoder"), ("bloom", "refused", "AttentionInterface"),
    # refused from the survey's findings (rlhf.models.family_checks): positions counted from padding_idx + 1
    ("roberta", "refused", "differed from HF on a tiny config"),
]


@pytest.mark.parametrize("model_type, path, why", SAMPLE)
def test_classification(model_type, path, why):
    got, reason = classify(model_type)
    assert got == path and why in reason and "\n" not in reason


def _doc_rows() -> dict[str, str]:
    rows = re.findall(r"^\| `([^`]+)` \| ([a-z]+)", DOC.read_text(), flags=re.M)
    return dict(rows)


def test_docs_table_lists_every_causal_lm_and_agrees_on_the_sample():
    rows = _doc_rows()
    assert set(rows) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)  # regenerate: python -m rlhf.models.generic
    for model_type, path, _ in SAMPLE:
        assert rows[model_type] == path


def test_a_fast_family_the_decoder_refuses_falls_back_to_generic():
    config = transformers.LlamaConfig(hidden_act="relu2")
    where = rollout_path(config)
    assert where.path == "generic" and "hidden activation 'relu2'" in where.reason


def test_decoder_blocks_found_generically():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64))
    assert decoder_blocks(gpt2) == list(gpt2.transformer.h)
    with torch.device("meta"):
        granite = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            "granite", num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64))
    assert decoder_blocks(granite) == list(granite.model.layers)
