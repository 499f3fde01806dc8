"""Loading verl-schema prompt files (parquet / jsonl)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.dataset import DataError, load_prompt_dataset


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _row(content, gt="5", **kw):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "train", "index": 0},
    }
    row.update(kw)
    return row


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_parquet_messages_with_chat_template(tmp_path, tok):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([_row("1+4="), _row("2+2=", gt="4")]), path)
    ds = load_prompt_dataset(path, tok)
    assert len(ds) == 2 and ds.stats.n_rows == 2 and ds.stats.n_loaded == 2
    ex = ds[1]
    assert ex.index == 1
    assert ex.prompt_text == "<|user|>2+2=<|assistant|>"
    assert ex.prompt_ids == tok.encode("<|user|>2+2=<|assistant|>", add_special_tokens=False)
    assert len(ex.prompt_ids) == 6  # 2 special tokens + 4 characters
    assert ex.ground_truth == "4" and ex.data_source == "openai/gsm8k"
    assert ex.extra_info == {"split": "train", "index": 0}


def test_jsonl_string_prompt_wrapped_as_user_message(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "3+3=", "ground_truth": 6}])
    ex = load_prompt_dataset(path, tok)[0]
    assert ex.prompt_text == "<|user|>3+3=<|assistant|>"
    assert ex.ground_truth == "6"
    assert ex.data_source == "unknown" and ex.extra_info == {}


def test_no_chat_template_tokenises_raw_text(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "3+3=", "answer": "3 and 3 make 6\n#### 6"}])
    ex = load_prompt_dataset(path, tok, apply_chat_template=False)[0]
    assert ex.prompt_text == "3+3="
    assert ex.prompt_ids == tok.encode("3+3=", add_special_tokens=False)
    assert ex.ground_truth == "6"  # GSM8K-style worked answer: what follows ####


def test_malformed_rows_skipped_and_counted(tmp_path, tok):
    rows = [
        _row("1+1=", gt="2"),
        "{not json",
        {"reward_model": {"ground_truth": "1"}},  # missing prompt
        _row("1+2="),  # fine
        {"prompt": 42, "ground_truth": "1"},  # wrong type
        {"prompt": [{"role": "user", "content": "x"}]},  # missing ground truth
        {"prompt": [{"role": "user"}], "ground_truth": "1"},  # message without content
    ]
    ds = load_prompt_dataset(_jsonl(tmp_path / "d.jsonl", rows), tok)
    assert [e.prompt_text for e in ds.examples] == ["<|user|>1+1=<|assistant|>", "<|user|>1+2=<|assistant|>"]
    assert [e.index for e in ds.examples] == [0, 1]
    s = ds.stats
    assert (s.n_rows, s.n_loaded, s.n_malformed) == (7, 2, 5)
    assert "row 1" in s.malformed_examples[0] and "invalid JSON" in s.malformed_examples[0]
    assert "row 2" in s.malformed_examples[1] and "missing 'prompt'" in s.malformed_examples[1]
    assert "row 4" in s.malformed_examples[2]
    assert "ground truth" in s.malformed_examples[3]


def test_lines_not_utf8_or_not_json_are_skipped_and_counted_once_each(tmp_path, tok):
    """issue 33: a line that is not UTF-8 ended the load with a UnicodeDecodeError naming no file;
    and a second invalid line was counted twice (its row number was off by one)."""
    path = tmp_path / "d.jsonl"
    good = json.dumps(_row("1+1=", gt="2")).encode()
    path.write_bytes(b"\n".join([good, b"{not json", b'{"prompt": "caf\xe9"}', b"[1,", good]) + b"\n")
    ds = load_prompt_dataset(path, tok)
    s = ds.stats
    assert (s.n_rows, s.n_loaded, s.n_malformed) == (5, 2, 3)
    assert [m.split(": ", 1)[0] for m in s.malformed_examples] == ["d.jsonl row 1", "d.jsonl row 2", "d.jsonl row 3"]
    assert "line 3: not UTF-8" in s.malformed_examples[1] and "line 4: invalid JSON" in s.malformed_examples[2]


def test_all_bad_file_raises_naming_file(tmp_path, tok):
    path = _jsonl(tmp_path / "bad.jsonl", [{"question": "x"}, "[1, 2"])
    with pytest.raises(DataError, match=r"bad\.jsonl.*none of its 2 rows.*row 0: missing 'prompt'"):
        load_prompt_dataset(path, tok)


def test_missing_file_and_bad_extension(tmp_path, tok):
    with pytest.raises(DataError, match="not found.*nope.parquet"):
        load_prompt_dataset(tmp_path / "nope.parquet", tok)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported dataset extension '.csv'"):
        load_prompt_dataset(tmp_path / "d.csv", tok)
    assert isinstance(DataError("x"), ValueError)


def test_overlong_filtered(tmp_path, tok):
    # "<|user|>" + content + "<|assistant|>" = len(content) + 2 tokens
    path = _jsonl(tmp_path / "d.jsonl", [_row("12345678"), _row("123")])
    ds = load_prompt_dataset(path, tok, max_prompt_length=6)
    assert len(ds) == 1 and ds[0].prompt_text == "<|user|>123<|assistant|>"
    assert (ds.stats.n_too_long, ds.stats.n_truncated) == (1, 0)


def test_overlong_truncated_left_right_error(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [_row("12345678")])
    full = tok.encode("<|user|>12345678<|assistant|>", add_special_tokens=False)
    left = load_prompt_dataset(path, tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="left")
    assert left[0].prompt_ids == full[-4:]
    assert left[0].prompt_text == "678<|assistant|>"
    assert left.stats.n_truncated == 1 and left.stats.n_too_long == 0
    right = load_prompt_dataset(path, tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="right")
    assert right[0].prompt_ids == full[:4]
    with pytest.raises(DataError, match="row 0.*10 tokens > max_prompt_length=4"):
        load_prompt_dataset(path, tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="error")


def test_everything_filtered_raises(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [_row("12345678")])
    with pytest.raises(DataError, match="1 longer than max_prompt_length=3"):
        load_prompt_dataset(path, tok, max_prompt_length=3)


def test_multiple_files_concatenate(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", [_row("1+1=")])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([_row("2+2="), _row("3+3=")]), b)
    ds = load_prompt_dataset([a, b], tok)
    assert [e.prompt_text[8:12] for e in ds.examples] == ["1+1=", "2+2=", "3+3="]
    assert [e.index for e in ds.examples] == [0, 1, 2]
    assert ds.stats.n_rows == 3
    assert [e.prompt_text for e in ds.select([2, 0])] == [ds[2].prompt_text, ds[0].prompt_text]


def test_synthetic_task_loads(tmp_path, tok):
    from rlhf.data.synthetic import make_addition_task

    paths = make_addition_task(tmp_path, n_train=10, n_val=4, n_sft=2)
    ds = load_prompt_dataset(paths["val"], tok, max_prompt_length=16)
    assert len(ds) == 4 and ds.stats.n_malformed == 0
    assert ds[0].data_source == "synthetic/addition"
    assert ds[0].extra_info == {"split": "val", "index": 0}
