"""Bad input ends the run with one clear line naming the problem (exit status 2)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.e2e.conftest import grpo_args, run_script, run_script_many


def _error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return lines[0]


ONE_LINE_ERRORS = [
    ({"model.path": "/no/such/model"}, "model.path: model directory not found: /no/such/model"),
    ({"reward.reward_fn": "gsm8kk"}, "reward.reward_fn: unknown reward function 'gsm8kk'"),
    ({"algorithm.adv_estimator": "grp0"}, "algorithm.adv_estimator"),
    ({"parallel.tp": 3}, "impossible parallel layout: world size 1 is not divisible by parallel.tp x parallel.pp"),
    ({"parallel.sp": 3}, "world size 1 is not divisible by parallel.tp x pp x sp = 1 x 1 x 3"),
    ({"parallel.sp": 1, "actor.ulysses_sequence_parallel_size": 2}, "disagree"),
    ({"trainer.mode": "one_step_off", "actor.tis_imp_ratio_cap": 2.0},
     "trainer.mode=one_step_off splits the world into two equal halves"),
    ({"actor.lrr": 1e-6}, "unknown config key 'actor.lrr'; did you mean actor.lr"),
    ({"rollout.n": "four"}, "config key 'rollout.n' must be int"),
    ({"data.train_files": "/no/such.parquet"}, "/no/such.parquet"),
    ({"algorithm.adv_estimator": "gdpo", "algorithm.gdpo_reward_keys": ["acc"],
      "algorithm.gdpo_reward_weights": [1.0, 2.0]}, "algorithm.gdpo_reward_weights has 2 entries for 1"),
    ({"rollout.multi_turn.enable": True}, "config key 'rollout.multi_turn.tool_config_path': is required"),
    ({"rollout.multi_turn.enable": True, "rollout.multi_turn.tool_config_path": "/no/tools.yaml"},
     "rollout.multi_turn.tool_config_path: tool config file not found: /no/tools.yaml"),
    # issue 33: these ran on (a traceback after the model load and a rollout, or silently)
    ({"actor.log_prob_micro_batch_size_per_gpu": 0}, "'actor.log_prob_micro_batch_size_per_gpu': must be > 0, got 0"),
    ({"trainer.total_training_steps": 0}, "'trainer.total_training_steps': must be >= 1 or -1"),
    ({"trainer.max_nan_steps": -1}, "'trainer.max_nan_steps': must be >= 0"),
    ({"data.max_response_length": 100000}, "data.max_response_length: prompt + response = 100016 tokens exceeds the "
                                           "model's max_position_embeddings"),
    ({"actor.lr": "[1,"}, "override 'actor.lr=[1,': the value '[1,' is not valid yaml"),
    ({"data.train_batch_size": 128, "actor.ppo_mini_batch_size": 128},
     "data.train_batch_size (128) is larger than the 64 training prompts of data.train_files"),
]


@pytest.fixture(scope="module")
def dry_runs(tiny_assets, tmp_path_factory):
    """Every dry run of this module in one interpreter (tests/e2e/_entry_driver.py): {name: result}."""
    d = tmp_path_factory.mktemp("user_errors")
    good = {"prompt": [{"role": "user", "content": "1+2="}], "reward_model": {"ground_truth": "3"},
            "data_source": "synthetic/addition"}
    rows = [json.dumps(good)] * 8 + ['{"prompt": 5}', "not json", json.dumps({"prompt": "2+2="})]
    (d / "mixed.jsonl").write_text("\n".join(rows) + "\n")
    # a line that is not UTF-8 is one more malformed row, not a crash without the file's name
    (d / "mixed_utf8.jsonl").write_bytes((d / "mixed.jsonl").read_bytes() + b'{"prompt": "caf\xe9"}\n')
    (d / "unusable.jsonl").write_text('{"prompt": 5}\nnot json\n')
    (d / "list.yaml").write_text("- model\n- data\n")
    (d / "a_file").write_text("not a directory")
    cases = {f"error{i}": grpo_args(tiny_assets, d / "o", **override) for i, (override, _) in enumerate(ONE_LINE_ERRORS)}
    cases.update({name: grpo_args(tiny_assets, d / "o", **{"data.train_files": d / f"{name}.jsonl"})
                  for name in ("mixed", "mixed_utf8", "unusable")})
    cases["ok"] = grpo_args(tiny_assets, d / "o")
    cases["listed"] = ["--config", str(d / "list.yaml")] + grpo_args(tiny_assets, d / "o")
    # a config.json cut off or hand-edited wrong: line 3 is `  "hidden_size": ,` (the value at column 18)
    shutil.copytree(tiny_assets / "model", d / "bad_model")
    (d / "bad_model" / "config.json").write_text('{\n  "vocab_size": 32,\n  "hidden_size": ,\n}\n')
    cases["bad_config_json"] = grpo_args(tiny_assets, d / "o", **{"model.path": d / "bad_model"})
    cases["taken"] = grpo_args(tiny_assets, d / "a_file")
    cases["under_taken"] = grpo_args(tiny_assets, d / "a_file" / "run")
    results = run_script_many("train_grpo.py", [["--dry-run"] + args for args in cases.values()])
    return d, dict(zip(cases, results))


@pytest.mark.parametrize("case", range(len(ONE_LINE_ERRORS)), ids=lambda i: str(ONE_LINE_ERRORS[i][1])[:40])
def test_one_line_errors(dry_runs, case):
    assert ONE_LINE_ERRORS[case][1] in _error_line(dry_runs[1][f"error{case}"])


def test_malformed_rows_skipped_and_counted(dry_runs):
    _, r = dry_runs
    assert r["mixed"].returncode == 0, r["mixed"].stderr[-2000:]
    assert "8/11 rows loaded; 3 malformed" in r["mixed"].stdout
    assert r["mixed_utf8"].returncode == 0, r["mixed_utf8"].stderr[-2000:]
    assert "8/12 rows loaded; 4 malformed" in r["mixed_utf8"].stdout and "line 12: not UTF-8" in r["mixed_utf8"].stdout
    line = _error_line(r["unusable"])
    assert "none of its 2 rows is usable" in line and "unusable.jsonl" in line


def test_dry_run_ok(dry_runs):
    r = dry_runs[1]["ok"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dry run OK" in r.stdout


def test_bad_config_file_and_output_dir_are_one_line(dry_runs):
    d, r = dry_runs
    assert f"config file {d / 'list.yaml'}: the top level must be a mapping" in _error_line(r["listed"])
    taken = d / "a_file"
    assert f"trainer.output_dir: {taken} exists and is not a directory" in _error_line(r["taken"])
    line = _error_line(r["under_taken"])
    assert f"trainer.output_dir: {taken / 'run'} cannot be created: {taken} is not a directory" in line
    assert taken.read_text() == "not a directory"


def test_a_malformed_config_json_is_one_line_naming_the_file_and_the_position(dry_runs):
    d, r = dry_runs
    assert _error_line(r["bad_config_json"]) == (f"error: model.path: {d / 'bad_model' / 'config.json'} is not valid "
                                                 f"JSON: Expecting value at line 3 column 18")


def test_a_reward_function_that_always_fails_stops_the_run_with_a_reason(tiny_assets, tmp_path):
    """No sample gets a reward: after reward.max_failed_steps steps in a row the run stops with one
    line (it went on for every step before); the rows already logged stay."""
    f = tmp_path / "broken_reward.py"
    f.write_text("def reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    raise RuntimeError('no grader')\n")
    out = tmp_path / "o"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
        "reward.reward_fn": f"{f}:reward", "reward.num_workers": 1, "reward.max_failed_steps": 2,
        "trainer.total_training_steps": 5, "data.val_files": ""}))
    line = _error_line(r)
    assert "reward.reward_fn: no sample got a reward in 2 steps in a row" in line and "16 raised" in line, line
    from rlhf.ops.metrics import read_metrics

    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1]


def test_a_reward_function_that_always_hangs_stops_the_run(tiny_assets, tmp_path):
    """Every call hangs: the first step costs its timeouts (with progress lines), the next one about one
    timeout (its untried rest times out at once), then one line says why the run stops."""
    f = tmp_path / "hanging_reward.py"
    f.write_text("import time\n\ndef reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    time.sleep(3600)\n")
    out = tmp_path / "o"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
        "reward.reward_fn": f"{f}:reward", "reward.num_workers": 2, "reward.timeout_s": 1,
        "reward.max_failed_steps": 2, "reward.score_during_generation": False,
        "trainer.total_training_steps": 5, "data.val_files": ""}))
    line = _error_line(r)
    assert "no sample got a reward in 2 steps in a row (last step: 16 of 16 calls timed out" in line, line
    lines = [l for l in r.stdout.splitlines() if "timed out on 16 (scored 0; " in l]
    assert len(lines) == 2, r.stdout[-3000:]  # one line per step
    assert (out / "metrics.jsonl").is_file()


def test_a_hanging_reward_with_defaults_costs_one_timeout_round_per_step(tiny_assets, tmp_path):
    """issue 55: every call hangs, default settings (4 workers, scoring during generation, 3 failed steps)
    but a 2 s timeout: each step tries about one call per worker, fails the rest at once (counted in
    reward/untried), and the run stops after reward.max_failed_steps with one line."""
    f = tmp_path / "hanging_reward.py"
    f.write_text("import time\n\ndef reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    time.sleep(3600)\n")
    out = tmp_path / "o"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
        "reward.reward_fn": f"{f}:reward", "reward.timeout_s": 2, "trainer.total_training_steps": 5,
        "data.val_files": ""}))
    line = _error_line(r)
    assert "no sample got a reward in 3 steps in a row (last step: 16 of 16 calls timed out" in line, line
    from rlhf.ops.metrics import read_metrics

    steps = [m for m in read_metrics(out / "metrics.jsonl") if "reward/untried" in m]
    assert [m["step"] for m in steps] == [1, 2]  # the third step ends the run before its row
    workers = 4  # reward.num_workers' default
    for m in steps:
        tried = m["reward/timeouts"] - m["reward/untried"]
        # one round: a call per worker, plus at most one more per worker started before the round ended
        assert m["reward/timeouts"] == 16 and 1 <= tried < 2 * workers, m
    assert len([l for l in r.stdout.splitlines() if "timed out on 16 (scored 0; " in l]) == 3
