"""The synthetic addition task and the character tokenizer."""

import json
import random

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.synthetic import (
    AdditionProblem,
    carry_dropped_response,
    correct_response,
    main,
    make_addition_task,
    teacher_response,
)
from rlhf.rewards import get_reward_fn


def test_response_formats_by_hand():
    assert correct_response(AdditionProblem(47, 38)) == "7+8=15;4+3+1=8 #### 85"
    assert carry_dropped_response(AdditionProblem(47, 38)) == "7+8=15;4+3=7 #### 75"
    assert correct_response(AdditionProblem(23, 41)) == "3+1=4;2+4=6 #### 64"
    assert correct_response(AdditionProblem(99, 99)) == "9+9=18;9+9+1=19 #### 198"
    assert carry_dropped_response(AdditionProblem(95, 17)) == "5+7=12;9+1=10 #### 102"


def test_gsm8k_reward_on_correct_and_flawed():
    fn = get_reward_fn("gsm8k")
    p = AdditionProblem(47, 38)
    assert fn("synthetic/addition", correct_response(p), "85") == 1.0
    assert fn("synthetic/addition", carry_dropped_response(p), "85") == 0.0
    assert get_reward_fn("default")("synthetic/addition", correct_response(p), "85") == 1.0


def test_teacher_never_errs_without_carry():
    rng = random.Random(0)
    p = AdditionProblem(23, 41)
    assert all(teacher_response(p, rng, 1.0) == correct_response(p) for _ in range(20))


def _read(out):
    train = pq.read_table(out / "train.parquet").to_pylist()
    val = pq.read_table(out / "val.parquet").to_pylist()
    sft = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    return train, val, sft


def test_files_schema_determinism_and_disjoint(tmp_path):
    make_addition_task(tmp_path / "a", n_train=300, n_val=50, n_sft=100, seed=3)
    make_addition_task(tmp_path / "b", n_train=300, n_val=50, n_sft=100, seed=3)
    make_addition_task(tmp_path / "c", n_train=300, n_val=50, n_sft=100, seed=4)
    a, b, c = _read(tmp_path / "a"), _read(tmp_path / "b"), _read(tmp_path / "c")
    assert a == b
    assert a[0] != c[0]
    train, val, sft = a
    assert (len(train), len(val), len(sft)) == (300, 50, 100)
    row = train[0]
    assert row["data_source"] == "synthetic/addition" and row["ability"] == "math"
    assert row["reward_model"]["style"] == "rule"
    assert row["extra_info"] == {"split": "train", "index": 0}
    assert val[7]["extra_info"] == {"split": "val", "index": 7}
    content = row["prompt"][0]["content"]
    assert row["prompt"][0]["role"] == "user" and content.endswith("=")
    x, y = map(int, content[:-1].split("+"))
    assert row["reward_model"]["ground_truth"] == str(x + y)
    train_prompts = {r["prompt"][0]["content"] for r in train}
    val_prompts = {r["prompt"][0]["content"] for r in val}
    assert len(train_prompts) == 300 and len(val_prompts) == 50
    assert not train_prompts & val_prompts
    assert {r["prompt"][0]["content"] for r in sft} <= train_prompts


def test_teacher_error_rate(tmp_path):
    make_addition_task(tmp_path, n_train=3000, n_val=10, n_sft=3000, seed=0, teacher_carry_error=0.6)
    _, _, sft = _read(tmp_path)
    n_carry = n_wrong = 0
    for r in sft:
        x, y = map(int, r["prompt"][0]["content"][:-1].split("+"))
        p = AdditionProblem(x, y)
        wrong = r["response"] != correct_response(p)
        if p.has_carry:
            n_carry += 1
            n_wrong += wrong
            assert r["response"] in (correct_response(p), carry_dropped_response(p))
        else:
            assert not wrong
    # 45% of problems carry -> ~1350 of them; 3 sigma of a binomial(0.6) rate is ~0.04
    assert n_carry > 1000
    assert abs(n_wrong / n_carry - 0.6) < 0.05


def test_cli(tmp_path, capsys):
    main(["--out", str(tmp_path), "--n-train", "20", "--n-val", "5", "--n-sft", "7"])
    train, val, sft = _read(tmp_path)
    assert (len(train), len(val), len(sft)) == (20, 5, 7)


def test_too_many_problems(tmp_path):
    with pytest.raises(ValueError, match="8100"):
        make_addition_task(tmp_path, n_train=8100, n_val=1)


# ---------------------------------------------------------------- char tokenizer

CHARSET_SAMPLE = "0123456789 abcXYZ +-*=#;,.?:()\n47+38=? 7+8=15;4+3+1=8 #### 85\nHello, World."


def test_char_tokenizer_round_trip_and_special_ids():
    tok = build_char_tokenizer()
    ids = tok.encode(CHARSET_SAMPLE, add_special_tokens=False)
    assert len(ids) == len(CHARSET_SAMPLE)  # one id per character
    assert tok.decode(ids) == CHARSET_SAMPLE
    for t in ("<pad>", "<eos>", "<|user|>", "<|assistant|>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    assert tok.decode(tok.encode("<|user|>a b<eos>", add_special_tokens=False), skip_special_tokens=True) == "a b"


def test_char_tokenizer_chat_template():
    tok = build_char_tokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "47+38="}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>s<|user|>47+38=<|assistant|>"
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "85"}], tokenize=False)
    assert full == "<|system|>s<|user|>47+38=<|assistant|>85<eos>"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False) == "<|system|>s<|user|>47+38="


def test_char_tokenizer_save_load(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok2.encode(CHARSET_SAMPLE, add_special_tokens=False)
    assert ids == tok.encode(CHARSET_SAMPLE, add_special_tokens=False)
    assert tok2.decode(ids) == CHARSET_SAMPLE
    assert (tok2.pad_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert len(tok2) == len(tok)
    msgs = [{"role": "user", "content": "1+2="}]
    assert tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "<|user|>1+2=<|assistant|>"


def test_char_tokenizer_custom_chars():
    tok = build_char_tokenizer("0123456789+=")
    assert len(tok) == 6 + 12
    assert tok.decode(tok.encode("12+3=15", add_special_tokens=False)) == "12+3=15"
    assert tok.encode("a", add_special_tokens=False) == [tok.unk_token_id]
