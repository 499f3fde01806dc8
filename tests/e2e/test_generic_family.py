"""A GRPO step on 2 ranks for families outside the fast list: FSDP2 over their blocks, padding-free
log-probs, the generic rollout path (rlhf.rollout.generic) and its one start-up line."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from rlhf.models.tiny import build_char_tokenizer
from tests.e2e.conftest import grpo_args, run_script, train_steps

EXTRA = {"granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
         "exaone4": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
         "seed_oss": dict(attention_bias=True)}


def write_family(out, kind: str):
    tok = build_char_tokenizer()
    config = transformers.AutoConfig.for_model(
        kind, vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False, **EXTRA[kind])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# granite trains with tp=2 from its base_model_tp_plan (rlhf.models.generic_tp); the others with dp=2
TP = {"granite": 2}


@pytest.mark.parametrize("kind", list(EXTRA))
def test_grpo_step_two_ranks_generic_path(tiny_assets, tmp_path, parity_reward, kind):
    model = write_family(tmp_path / "m", kind)
    args = grpo_args(tiny_assets, tmp_path / "o", **{"model.path": model, "trainer.total_training_steps": 1,
                                                       "parallel.tp": TP.get(kind, 1),
                                                       "reward.reward_fn": parity_reward,
                                                       "trainer.test_freq": -1, "trainer.val_before_train": False})
    r = run_script("train_grpo.py", args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    tp = TP.get(kind, 1)
    assert f"layout dp={2 // tp} tp={tp} " in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if "runs on the generic path" in ln]
    assert len(lines) == 1 and kind in lines[0]  # rank 0 says it once
    step = train_steps(tmp_path / "o" / "metrics.jsonl")[1]
    assert math.isfinite(step["actor/loss"]) and step["rollout/tokens_generated"] > 0
