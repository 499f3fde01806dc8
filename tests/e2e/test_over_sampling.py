"""rollout.over_sample_rate end to end (issue 55): long-tail responses, groups aborted, no prompt lost.

One-process runs of the tiny task (8 prompts x 2 samples a step, responses stopped at any of
8 characters: most short, a few long): over-sampling at 0.25 for 4 steps with checkpoints at 2 and
4; the same without over-sampling for 6 steps; and the first run resumed from its step-2
checkpoint; and over-sampling with DAPO's filter_groups. A reward function logs the dataset index of every scored sample: the trained prompts.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tests.e2e.conftest import grpo_args, run_script_many, train_steps

LOG_INDEX = '''
def log_index(data_source, solution_str, ground_truth, extra_info=None):
    with open({path!r}, "a") as f:
        f.write(str(extra_info["index"]) + "\\n")
    return float(len(solution_str) % 2)
'''


def _case(assets: Path, tmp: Path, name: str, steps: int, **over) -> list[str]:
    (tmp / f"{name}.py").write_text(LOG_INDEX.format(path=str(tmp / f"{name}.log")))
    return grpo_args(assets, tmp / name, **{
        "reward.reward_fn": f"{tmp / name}.py:log_index", "data.val_files": "", "trainer.val_before_train": False,
        "trainer.test_freq": -1, "trainer.total_training_steps": steps, "actor.ppo_mini_batch_size": 8,
        "rollout.stop": "[a,b,c,d,e,f,g,h]", "data.max_response_length": 24, **over})


def _trained(tmp: Path, name: str, steps: int = 0, n: int = 2) -> list[int]:
    """Trained prompts of the run (of its first ``steps`` steps: steps are scored one after the other, a
    step's samples in any order by the reward workers), sorted; asserts each was scored n times (never
    trained twice)."""
    rows = (tmp / f"{name}.log").read_text().split()
    counts = Counter(int(x) for x in (rows[:steps * 8 * n] if steps else rows))
    assert set(counts.values()) == {n}, counts
    return sorted(counts)


def test_aborted_prompts_return_and_an_epoch_sees_each_prompt_once(tiny_assets, tmp_path):
    over = {"rollout.over_sample_rate": 0.25, "checkpoint.save_freq": 2, "checkpoint.max_to_keep": 0}
    resume = tmp_path / "over" / "checkpoints" / "global_step_2"
    runs = run_script_many("train_grpo.py", [
        _case(tiny_assets, tmp_path, "over", 4, **over),
        _case(tiny_assets, tmp_path, "plain", 6),
        _case(tiny_assets, tmp_path, "resumed", 4, **over, **{"checkpoint.resume": resume}),
        _case(tiny_assets, tmp_path, "dapo", 2, **{"rollout.over_sample_rate": 0.25,
                                                   "algorithm.filter_groups.enable": True,
                                                   "algorithm.filter_groups.metric": "score"})])
    for r in runs:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    metrics = train_steps(tmp_path / "over" / "metrics.jsonl")
    assert [m["rollout/over_sample_started"] for m in metrics.values()] == [11.0] * 4  # int(11 x 0.75) = 8
    assert sum(m["rollout/aborted"] for m in metrics.values()) > 0  # the long tail was cut
    assert all(m["rollout/over_sample_saved_s"] >= 0 for m in metrics.values())
    over_idx = _trained(tmp_path, "over")
    assert len(over_idx) == 4 * 8  # whole batches, no prompt twice (64 prompts: one epoch)
    state = json.loads((tmp_path / "over" / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())
    waiting = state["loader"]["waiting"]
    assert waiting and not set(waiting) & set(over_idx)
    # None lost: trained + still waiting = what the loader handed out = the plain run's first batches
    handed = sorted(over_idx + waiting)
    assert len(handed) % 8 == 0 and len(set(handed)) == len(handed)
    assert handed == _trained(tmp_path, "plain", steps=len(handed) // 8)
    # The given-back prompts survive the step-2 checkpoint: the resumed run trains steps 3-4 on the same
    # prompts (data/batch_fingerprint: of the prompts a step used, in order)
    resumed = train_steps(tmp_path / "resumed" / "metrics.jsonl")
    assert [resumed[k]["data/batch_fingerprint"] for k in (3, 4)] == \
        [metrics[k]["data/batch_fingerprint"] for k in (3, 4)]
    # With DAPO's filter_groups each generation batch is over-sampled; the step still trains 8 groups
    dapo = train_steps(tmp_path / "dapo" / "metrics.jsonl")
    assert len(dapo) == 2 and all(m["dynamic_sampling/kept_groups"] >= 8 for m in dapo.values())
    assert all(m["rollout/over_sample_started"] == 11.0 for m in dapo.values())


def test_one_step_off_rollout_role_aborts_and_the_training_side_keeps_the_order(tiny_assets, tmp_path):
    """one_step_off on 1 + 1 ranks: the rollout role over-samples; the training side mirrors the data order
    from its messages, so its checkpoint holds the waiting prompts: trained + waiting = the loader's batches."""
    from rlhf.data.loader import PromptLoader
    from tests.e2e.conftest import run_script

    args = _case(tiny_assets, tmp_path, "off", 4, **{"rollout.over_sample_rate": 0.25, "trainer.mode": "one_step_off",
                                                    "actor.tis_imp_ratio_cap": 2.0, "checkpoint.save_freq": 4})
    r = run_script("train_grpo.py", args, nproc=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    metrics = train_steps(tmp_path / "off" / "metrics.jsonl")
    assert [m["rollout/over_sample_started"] for m in metrics.values()] == [11.0] * 4
    assert sum(m["rollout/aborted"] for m in metrics.values()) > 0
    loader = json.loads((tmp_path / "off" / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())["loader"]
    handed = sorted(_trained(tmp_path, "off") + loader["waiting"])
    order = PromptLoader(loader["dataset_len"], 8, seed=loader["seed"]).epoch_order(0)
    assert len(handed) == loader["position"] * 8 and handed == sorted(order[:len(handed)])
