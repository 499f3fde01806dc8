"""A bf16 rollout against the fp32 trainer on CPU (``rollout.dtype``), corrected by truncated IS.

On a GPU the sampler runs in bf16 while the trainer recomputes log-probs in fp32 master
weights; ``rollout.dtype: bfloat16`` reproduces that mismatch on CPU. The sampler's
log-probs then differ from the trainer's (bf16 rounding, ~1e-3, where an fp32 rollout
agrees to ~1e-5), ``actor.tis_imp_ratio_cap`` reweights the update, and the policy still
learns a dense reward (shorter answers score more) in a few steps.
"""

from __future__ import annotations

from tests.e2e.conftest import grpo_args, run_script, train_steps

SHORT_REWARD = '''
def short(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 - min(len(solution_str), 12) / 12
'''


def test_bf16_rollout_with_truncated_is_learns(tiny_assets, tmp_path):
    reward = tmp_path / "short.py"
    reward.write_text(SHORT_REWARD)
    args = grpo_args(tiny_assets, tmp_path / "out", **{
        "reward.reward_fn": f"{reward}:short", "data.val_files": "", "rollout.dtype": "bfloat16", "rollout.n": 4,
        "actor.tis_imp_ratio_cap": 2.0, "actor.lr": 1e-2, "trainer.total_training_steps": 8})
    r = run_script("train_grpo.py", args)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = train_steps(tmp_path / "out" / "metrics.jsonl")
    assert sorted(steps) == list(range(1, 9))
    assert all(m["rollout/logprob_diff_max"] > 5e-4 for m in steps.values())  # bf16 sampler vs fp32 trainer
    first = (steps[1]["reward/mean"] + steps[2]["reward/mean"]) / 2
    last = (steps[7]["reward/mean"] + steps[8]["reward/mean"]) / 2
    assert last > first + 0.15, (first, last)
