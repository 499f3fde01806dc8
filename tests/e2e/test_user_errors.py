"""Bad input ends the run with one clear line naming the problem (exit status 2)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import grpo_args, run_script


def _error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("override, expect", [
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
])
def test_one_line_errors(tiny_assets, tmp_path, override, expect):
    r = run_script("train_grpo.py", ["--dry-run"] + grpo_args(tiny_assets, tmp_path / "o", **override))
    assert expect in _error_line(r)


def test_malformed_rows_skipped_and_counted(tiny_assets, tmp_path):
    good = {"prompt": [{"role": "user", "content": "1+2="}], "reward_model": {"ground_truth": "3"},
            "data_source": "synthetic/addition"}
    rows = [json.dumps(good)] * 8 + ['{"prompt": 5}', "not json", json.dumps({"prompt": "2+2="})]
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(rows) + "\n")
    r = run_script("train_grpo.py", ["--dry-run"] + grpo_args(tiny_assets, tmp_path / "o", **{"data.train_files": f}))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "8/11 rows loaded; 3 malformed" in r.stdout
    f.write_text('{"prompt": 5}\nnot json\n')
    line = _error_line(run_script("train_grpo.py",
                                  ["--dry-run"] + grpo_args(tiny_assets, tmp_path / "o", **{"data.train_files": f})))
    assert "none of its 2 rows is usable" in line and "mixed.jsonl" in line


def test_dry_run_ok(tiny_assets, tmp_path):
    r = run_script("train_grpo.py", ["--dry-run"] + grpo_args(tiny_assets, tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dry run OK" in r.stdout
