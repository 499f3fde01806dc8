"""trainer.mode fully_async end to end: 1 training + 2 rollout ranks (an unequal split) with
staleness_threshold 0 and trigger_parameter_sync_step 1 is the synchronous algorithm, so every
metric of every step equals the colocated one-process run's (1e-6), while the groups stream in
from two rollout replicas in whatever order they finish."""

from __future__ import annotations

from tests.e2e.conftest import PARITY_REWARD, grpo_args, run_script, train_steps

STEPS = 3
# Not comparable: wall-clock figures, and what only one mode logs (the colocated sampler's and reshard's
# statistics; the rollout role's own).
SKIP = ("timing/", "perf/", "rollout/", "reshard/", "async/", "step", "data/epoch_progress")


def test_zero_staleness_equals_colocated_on_every_metric(tiny_assets, tmp_path):
    reward = tmp_path / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    common = {"reward.reward_fn": f"{reward}:parity", "data.val_files": "", "trainer.total_training_steps": STEPS,
              "rollout.max_num_seqs": 3}
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "sync", **common))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "async", **common, **{
        "trainer.mode": "fully_async", "parallel.rollout_ranks": 2, "async_training.require_batches": 2,
        "async_training.staleness_threshold": 0, "async_training.trigger_parameter_sync_step": 1}), nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    sync, lagged = train_steps(tmp_path / "sync" / "metrics.jsonl"), train_steps(tmp_path / "async" / "metrics.jsonl")
    assert sorted(lagged) == sorted(sync) == list(range(1, STEPS + 1))
    compared = 0
    for step, row in sync.items():
        for key, value in row.items():
            if key.startswith(SKIP) or not isinstance(value, (int, float)):
                continue
            assert abs(lagged[step][key] - value) <= 1e-6 * max(1.0, abs(value)), (step, key, value, lagged[step][key])
            compared += 1
        a = lagged[step]
        assert a["async/staleness_max"] == 0.0 and a["async/samples_dropped"] == 0
        assert 0.0 <= a["async/trainer_idle_share"] <= 1.0 and 0.0 <= a["async/rollout_idle_share"] <= 1.0
    assert compared > 20 * STEPS  # losses, grad norms, rewards, lengths, advantages, data fingerprint, ...
