"""The 3-digit addition task (rlhf/data/addition3.py): worked answers by hand, the flawed teacher, files."""

import json

import pyarrow.parquet as pq

from rlhf.data.addition3 import make_addition3_task, worked_response
from rlhf.rewards.registry import get_reward_fn


def test_worked_answers_by_hand():
    assert worked_response(487, 358) == "7+8=15;8+5+1=14;4+3+1=8 #### 845"
    assert worked_response(487, 358, (False, True)) == "7+8=15;8+5=13;4+3+1=8 #### 835"
    assert worked_response(487, 358, (True, False)) == "7+8=15;8+5+1=14;4+3=7 #### 745"
    assert worked_response(999, 999) == "9+9=18;9+9+1=19;9+9+1=19 #### 1998"


def test_task_files_deterministic_and_scored_by_the_default_reward(tmp_path):
    a = make_addition3_task(tmp_path / "a", n_train=50, n_val=10, n_sft=40, seed=3)
    b = make_addition3_task(tmp_path / "b", n_train=50, n_val=10, n_sft=40, seed=3)
    assert a["sft"].read_text() == b["sft"].read_text()
    train, val = pq.read_table(a["train"]).to_pylist(), pq.read_table(a["val"]).to_pylist()
    prompts = {r["prompt"][0]["content"] for r in train}
    assert len(prompts) == 50 and not prompts & {r["prompt"][0]["content"] for r in val}
    reward = get_reward_fn("default", {})
    demos = [json.loads(line) for line in a["sft"].read_text().splitlines()]
    right = 0
    for d in demos:
        x, y = map(int, d["prompt"][0]["content"].rstrip("=").split("+"))
        score = reward("synthetic/addition", d["response"], str(x + y))
        right += (score["score"] if isinstance(score, dict) else score) >= 1.0
    assert 0 < right < len(demos)  # the teacher drops carries, not always
