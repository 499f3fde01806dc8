"""python -m rlhf.data.prepare: published GSM8K / MATH / DAPO-Math-17k layouts -> verl schema."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.data.char_tokenizer import build_char_tokenizer
from rlhf.data.dataset import DataError, load_prompt_dataset
from rlhf.data.prepare import GSM8K_INSTRUCTION, MATH_INSTRUCTION, main, prepare

GSM8K_ROWS = [  # openai/gsm8k "main": question, answer (worked solution, "#### n")
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day for 2 days. How many eggs?", "answer": "1,200*2=2,400\n#### 2,400"},
    {"question": "No final line here.", "answer": "It is 5."},
    {"question": "", "answer": "#### 1"},
    {"question": "Negative?", "answer": "#### -3"},
]

MATH_ROWS = [  # DigitalLearningGmbH/MATH-lighteval: problem, level, type, solution
    {"problem": "What is $1/2 + 1/4$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We get $\\frac{2}{4}+\\frac14=\\boxed{\\frac{3}{4}}$."},
    {"problem": "Solve $x^2=4$, $x>0$.", "level": "Level 2", "type": "Algebra",
     "solution": "First $\\boxed{-2}$ is rejected, so $x=\\boxed{2}$."},
    {"problem": "No box.", "level": "Level 1", "type": "Algebra", "solution": "The answer is 3."},
]

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


def _dapo_row(q, gt, uid):  # BytedTsinghua-SIA/DAPO-Math-17k, as published (already verl schema)
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_PROMPT.format(q=q), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": gt, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": uid}}


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_gsm8k(tmp_path):
    src = _parquet(tmp_path / "train-00000-of-00001.parquet", GSM8K_ROWS)
    report = prepare("gsm8k", [str(src)], str(tmp_path / "out"))
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2400", "-3"]
    r = rows[0]
    assert r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
    assert r["prompt"] == [{"role": "user", "content": GSM8K_ROWS[0]["question"] + " " + GSM8K_INSTRUCTION}]
    assert r["reward_model"]["style"] == "rule"
    assert r["extra_info"]["split"] == "train" and [x["extra_info"]["index"] for x in rows] == [0, 1, 2]
    assert report.n_read == 5 and report.written == {"train": 3}
    assert report.skipped == {"no '#### <number>' in answer": 1, "empty 'question'": 1}
    assert "2 skipped" in report.summary() and "first: row 2" in report.summary()
    # the output is what the trainer loads, and its ground truths score with the gsm8k reward
    ds = load_prompt_dataset(tmp_path / "out" / "train.parquet", build_char_tokenizer(), max_prompt_length=4096)
    assert len(ds) == 3 and ds[1].ground_truth == "2400"


def test_math_jsonl_with_test_split(tmp_path):
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS * 2))
    report = prepare("math", [str(src)], str(tmp_path / "out"), test_size=0.5, seed=3, fmt="jsonl")
    train = [json.loads(x) for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (tmp_path / "out" / "test.jsonl").read_text().splitlines()]
    assert report.written == {"train": 2, "test": 2} and report.skipped == {"no \\boxed{} answer in solution": 2}
    assert sorted(r["reward_model"]["ground_truth"] for r in train + test) == ["2", "2", "\\frac{3}{4}", "\\frac{3}{4}"]
    assert {r["extra_info"]["split"] for r in test} == {"test"} and [r["extra_info"]["index"] for r in test] == [0, 1]
    r = train[0]
    assert r["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert r["prompt"][0]["content"].endswith(" " + MATH_INSTRUCTION)
    assert r["extra_info"]["level"].startswith("Level")


def test_math500_answer_column_and_data_source(tmp_path):
    src = tmp_path / "test.jsonl"  # HuggingFaceH4/MATH-500: problem, solution, answer, subject, level, unique_id
    src.write_text(json.dumps({"problem": "p", "solution": "... \\boxed{\\dfrac{1}{2}}", "answer": "\\frac{1}{2}",
                               "subject": "Algebra", "level": 2, "unique_id": "test/algebra/1.json"}) + "\n")
    prepare("math", [str(src)], str(tmp_path / "out"), split="test", data_source="HuggingFaceH4/MATH-500")
    (row,) = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert row["reward_model"]["ground_truth"] == "\\frac{1}{2}" and row["data_source"] == "HuggingFaceH4/MATH-500"


def test_dapo_math_dedups_and_reindexes(tmp_path):
    rows = [_dapo_row("What is 2+3?", "5", "a-1"), _dapo_row("What is 6*7?", "42", "b-2"),
            _dapo_row("What is 2+3?", "5", "a-1"), _dapo_row("No answer", "", "c-3")]
    src = _parquet(tmp_path / "dapo-math-17k.parquet", rows)
    report = prepare("dapo_math", [str(src)], str(tmp_path / "out"))
    out = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in out] == ["5", "42"]
    assert out[1]["data_source"] == "math_dapo" and out[1]["prompt"][0]["content"].endswith('after "Answer:".')
    assert out[1]["extra_info"] == {"split": "train", "index": 1, "original_index": "b-2"}
    assert report.skipped == {"duplicate prompt": 1, "no reward_model.ground_truth": 1}


def test_wrong_layout_names_the_missing_column(tmp_path, capsys):
    src = _parquet(tmp_path / "x.parquet", [{"problem": "p", "solution": "\\boxed{1}"}])
    with pytest.raises(SystemExit) as e:
        main(["gsm8k", "--in", str(src), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "column 'question' missing for the gsm8k layout" in err and "found: problem" in err


def test_unknown_dataset_lists_known_ones(tmp_path):
    with pytest.raises(DataError, match="unknown dataset 'gsm9k'; known: dapo_math, geo3k, gsm8k, math"):
        prepare("gsm9k", ["x.parquet"], str(tmp_path))


def test_cli_prints_counts(tmp_path):
    src = _parquet(tmp_path / "g.parquet", GSM8K_ROWS)
    out = subprocess.run([sys.executable, "-m", "rlhf.data.prepare", "gsm8k", "--in", str(src), "--out",
                          str(tmp_path / "o"), "--test-size", "1"], capture_output=True, text=True, check=True)
    assert "5 rows read, 3 written (train 2, test 1); 2 skipped" in out.stdout
