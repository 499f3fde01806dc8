"""python -m rlhf.eval: pass@k / maj@k from the CLI agree with a hand count over its own
generations, and 1 and 2 ranks produce the same generations."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter, defaultdict

from tests.e2e.conftest import ROOT

REWARD = '''
def first_char(data_source, solution_str, ground_truth, extra_info=None):
    # Varied correctness from a random model; "pred" (the first character) feeds maj@k.
    ok = float(len(solution_str) % 2)
    return {"score": ok, "acc": ok, "pred": solution_str[:1]}
'''


def _eval(assets, out, reward, nproc=1, extra=()):
    args = ["--model", str(assets / "model"), "--data", str(assets / "data" / "val.parquet"), "--num-samples", "4",
            "--temperature", "1.0", "--max-new-tokens", "12", "--max-prompt-length", "16", "--reward", reward,
            "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + ["-m", "rlhf.eval", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)


def test_eval_cli_metrics_match_hand_count_and_ranks(tiny_assets, tmp_path):
    (tmp_path / "r.py").write_text(REWARD)
    reward = f"{tmp_path / 'r.py'}:first_char"
    r1 = _eval(tiny_assets, tmp_path / "one", reward)
    assert r1.returncode == 0, r1.stderr[-3000:]
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())["summary"]["all"]
    rows = [json.loads(line) for line in (tmp_path / "one" / "generations.jsonl").read_text().splitlines()]
    by_prompt = defaultdict(list)
    for row in rows:
        by_prompt[row["key"]].append(row)
    assert len(by_prompt) == 16 and all(len(v) == 4 for v in by_prompt.values())
    # hand count: pass@k = mean over prompts of 1 - C(n-c, k) / C(n, k); maj@4 = the majority's correctness
    for k in (1, 2, 4):
        want = sum(1 - math.comb(4 - int(sum(r["acc"] for r in v)), k) / math.comb(4, k) for v in by_prompt.values()) / 16
        assert abs(summary[f"pass@{k}"] - want) < 1e-12, k
    maj = 0.0
    for v in by_prompt.values():
        v = sorted(v, key=lambda r: r["sample"])
        votes = Counter(r["pred"] for r in v)
        top = max(votes.values())
        maj += next(r for r in v if votes[r["pred"]] == top)["acc"]
    assert abs(summary["maj@4"] - maj / 16) < 1e-12
    assert 0 < summary["pass@1"] < summary["pass@4"] <= 1  # the reward varies, so the curve rises
    assert summary["response_length"] == sum(r["length"] for r in rows) / len(rows)

    r2 = _eval(tiny_assets, tmp_path / "two", reward, nproc=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert (tmp_path / "two" / "generations.jsonl").read_text() == (tmp_path / "one" / "generations.jsonl").read_text()


def test_eval_cli_user_errors(tiny_assets, tmp_path):
    r = _eval(tiny_assets, tmp_path / "o", "default", extra=("--temperature", "0"))
    assert r.returncode == 2 and "error: --n 4 with greedy decoding" in r.stderr
    r = _eval(tiny_assets, tmp_path / "o", "no_such_reward")
    assert r.returncode == 2 and "error: --reward: unknown reward function 'no_such_reward'" in r.stderr


def test_validation_samples_with_val_kwargs(tiny_assets, tmp_path, parity_reward):
    from rlhf.ops.metrics import read_metrics
    from tests.e2e.conftest import grpo_args, run_script

    over = {"reward.reward_fn": parity_reward, "trainer.total_training_steps": 1, "trainer.val_kwargs.do_sample": True,
            "trainer.val_kwargs.n": 4, "trainer.val_kwargs.temperature": 1.0}
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "out", **over))
    assert r.returncode == 0, r.stderr[-3000:]
    val = [m for m in read_metrics(tmp_path / "out" / "metrics.jsonl") if "val/acc" in m]
    assert len(val) == 2  # before and after training
    for m in val:
        assert m["val/n"] == 16 * 4 and m["val/pass@1"] == m["val/acc"]
        assert m["val/pass@1"] <= m["val/pass@2"] <= m["val/pass@4"] and 0 < m["val/pass@4"] <= 1
