"""The tools quickstart's multiplication task: shapes of problems, demonstrations and files."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from rlhf.data.arithmetic import make_multiplication_task


def test_task_files(tmp_path):
    paths = make_multiplication_task(tmp_path, n_train=50, n_val=10, n_sft=200, teacher_tool_rate=0.5)
    train, val = pq.read_table(paths["train"]).to_pylist(), pq.read_table(paths["val"]).to_pylist()
    prompts = [r["prompt"][0]["content"] for r in train + val]
    assert len(set(prompts)) == 60  # distinct problems, val disjoint from train
    for r in train + val:
        a, b = r["prompt"][0]["content"].rstrip("=").split("*")
        assert len(a) == len(b) == 3 and r["reward_model"]["ground_truth"] == str(int(a) * int(b))
        assert len(r["reward_model"]["ground_truth"]) == 6
    demos = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    with_tool = [d for d in demos if len(d["response"]) == 3]
    assert len(demos) == 200 and 70 < len(with_tool) < 130
    d = with_tool[0]
    expr = d["prompt"][0]["content"].rstrip("=")
    assert d["response"][0]["content"] == \
        '<tool_call>{"name":"calculator","arguments":{"expression":"%s"}}</tool_call>' % expr
    assert d["response"][1] == {"role": "tool", "content": str(eval(expr))}
    assert d["response"][2]["content"] == f"#### {eval(expr)}"
    estimates = [d for d in demos if len(d["response"]) == 1]
    a, b = map(int, estimates[0]["prompt"][0]["content"].rstrip("=").split("*"))
    assert estimates[0]["response"][0]["content"] == f"~{round(a, -2) * round(b, -2)}"
    assert make_multiplication_task(tmp_path / "again", n_train=50, n_val=10, n_sft=200,
                                    teacher_tool_rate=0.5)["sft"].read_text() == paths["sft"].read_text()
