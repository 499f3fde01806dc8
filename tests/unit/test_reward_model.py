"""Reward-model scoring (rlhf.rewards.reward_model) with a tiny sequence-classification model.

The actor uses the project's character tokenizer; the reward model a character tokenizer
with a different id order and its own chat template, so feeding actor ids to it would
produce a different (wrong) text. The scorer must re-tokenise from text.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf.data.char_tokenizer import DEFAULT_CHARS, build_char_tokenizer
from rlhf.rewards.reward_model import RewardModelScorer
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import ConfigError, RewardModelConfig

P, R = 16, 32
RM_TEMPLATE = ("{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{ 'Q: ' + m['content'] + '\n' }}"
               "{%- else -%}{{ 'A: ' + m['content'] }}{%- endif -%}{%- endfor -%}")
PROMPTS = ["47+38=", "9+1="]
RESPONSES = ["7+8=15;4+3+1=8 #### 85", "10 #### 10"]


def _rm_tokenizer():
    tok = build_char_tokenizer(DEFAULT_CHARS[::-1])  # same characters, different ids
    tok.chat_template = RM_TEMPLATE
    return tok


def _save_rm(path, tok, num_labels: int = 1) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels,
                                   pad_token_id=tok.pad_token_id)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval()


def _actor_batch(actor_tok) -> RolloutBatch:
    """Rows as the rollout engine builds them: rendered prompt left-padded | response + eos right-padded."""
    n = len(PROMPTS)
    ids = torch.full((n, P + R), actor_tok.pad_token_id)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        pid = actor_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=False)
        pid = actor_tok(pid, add_special_tokens=False)["input_ids"]
        rid = actor_tok(r, add_special_tokens=False)["input_ids"] + [actor_tok.eos_token_id]
        ids[i, P - len(pid):P], attn[i, P - len(pid):P] = torch.tensor(pid), 1
        ids[i, P:P + len(rid)], attn[i, P:P + len(rid)] = torch.tensor(rid), 1
    return RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=attn[:, P:].float(),
                        index=torch.arange(n), rollout_log_probs=torch.zeros(n, R),
                        truncated=torch.zeros(n, dtype=torch.bool), response_texts=list(RESPONSES))


def _hf_score(model, tok, text: str) -> float:
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def test_mismatched_tokenizer_is_retokenised_from_text(mesh, tmp_path):
    actor_tok, rm_tok = build_char_tokenizer(), _rm_tokenizer()
    rm = _save_rm(tmp_path, rm_tok)
    batch = _actor_batch(actor_tok)
    scorer = RewardModelScorer(RewardModelConfig(enable=True, path=str(tmp_path)), mesh, torch.device("cpu"),
                               actor_tok)
    assert scorer.retokenize
    # The actor's "<|user|>...<|assistant|>" wrapper is stripped, the RM's own template applied.
    expected = [f"Q: {p}\nA: {r}" for p, r in zip(PROMPTS, RESPONSES)]
    assert scorer.user_prompts(batch) == PROMPTS
    assert scorer.texts(batch) == expected
    ids = scorer.token_ids(batch)
    assert [rm_tok.decode(r) for r in ids] == expected
    # Actor ids would read as different text under the RM vocabulary: re-tokenising matters.
    assert ids[1] != actor_tok(expected[1], add_special_tokens=False)["input_ids"]
    scores = scorer.score(batch)
    assert scores.shape == (2,) and scores.dtype == torch.float32
    for i, text in enumerate(expected):
        assert scores[i].item() == pytest.approx(_hf_score(rm, rm_tok, text), abs=1e-4)


def test_long_inputs_keep_their_last_max_length_tokens(mesh, tmp_path):
    actor_tok, rm_tok = build_char_tokenizer(), _rm_tokenizer()
    rm = _save_rm(tmp_path, rm_tok)
    batch = _actor_batch(actor_tok)
    cfg = RewardModelConfig(enable=True, path=str(tmp_path), max_length=12, micro_batch_size_per_gpu=1)
    scorer = RewardModelScorer(cfg, mesh, torch.device("cpu"), actor_tok)
    full = f"Q: {PROMPTS[0]}\nA: {RESPONSES[0]}"
    assert rm_tok.decode(scorer.token_ids(batch)[0]) == full[-12:]
    assert scorer.score(batch)[0].item() == pytest.approx(_hf_score(rm, rm_tok, full[-12:]), abs=1e-4)


def test_same_tokenizer_uses_actor_ids(mesh, tmp_path):
    actor_tok = build_char_tokenizer()
    rm = _save_rm(tmp_path, build_char_tokenizer())
    batch = _actor_batch(actor_tok)
    scorer = RewardModelScorer(RewardModelConfig(enable=True, path=str(tmp_path)), mesh, torch.device("cpu"),
                               actor_tok)
    assert not scorer.retokenize
    scores = scorer.score(batch)
    for i in range(len(PROMPTS)):
        real = batch.input_ids[i][batch.attention_mask[i].bool()]  # prompt | response | eos, no padding
        with torch.no_grad():
            ref = float(rm(input_ids=real[None]).logits[0, 0])
        assert scores[i].item() == pytest.approx(ref, abs=1e-4)
    # max_length cuts the same rows from the left, like the re-tokenised path
    short = RewardModelScorer(RewardModelConfig(enable=True, path=str(tmp_path), max_length=9), mesh,
                              torch.device("cpu"), actor_tok)
    real = batch.input_ids[0][batch.attention_mask[0].bool()][-9:]
    with torch.no_grad():
        assert short.score(batch)[0].item() == pytest.approx(float(rm(input_ids=real[None]).logits[0, 0]), abs=1e-4)


def test_separate_tokenizer_path_always_retokenises(mesh, tmp_path):
    actor_tok = build_char_tokenizer()
    _save_rm(tmp_path / "rm", build_char_tokenizer())
    actor_tok.save_pretrained(tmp_path / "tok")
    cfg = RewardModelConfig(enable=True, path=str(tmp_path / "rm"), tokenizer_path=str(tmp_path / "tok"))
    scorer = RewardModelScorer(cfg, mesh, torch.device("cpu"), actor_tok)
    assert scorer.retokenize
    # char template: prompt + response re-rendered as one chat, assistant turn closed with <eos>
    assert scorer.texts(_actor_batch(actor_tok))[1] == "<|user|>9+1=<|assistant|>10 #### 10<eos>"


def test_multi_label_reward_model_is_rejected(mesh, tmp_path):
    _save_rm(tmp_path, _rm_tokenizer(), num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=2"):
        RewardModelScorer(RewardModelConfig(enable=True, path=str(tmp_path)), mesh, torch.device("cpu"),
                          build_char_tokenizer())
