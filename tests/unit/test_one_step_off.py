"""trainer.mode one_step_off pieces that need no process group: start-up checks, schedule, IS metrics."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.config.load import load_config
from rlhf.schema.config import ConfigError
from rlhf.train.async_rl.pipeline import Schedule, offpolicy_metrics
from rlhf.train.async_rl.roles import check_one_step_off


def _cfg(**over):
    over = {"model.path": "m", "data.train_files": "t.parquet", "trainer.mode": "one_step_off",
            "actor.tis_imp_ratio_cap": 2.0, **over}
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


@pytest.mark.parametrize("world, over, expect", [
    (3, {}, "world size 3 is odd"),
    (1, {}, "world size 1 is below 2"),
    (4, {"parallel.rollout_ranks": 1}, "supports only an even split"),
    (2, {"rollout.tp": 2}, "rollout group of 1 ranks cannot hold the rollout layout"),
    (4, {"actor.tis_imp_ratio_cap": -1}, "set actor.tis_imp_ratio_cap"),
    (4, {"algorithm.filter_groups.enable": True}, "does not support algorithm.filter_groups"),
    (4, {"algorithm.adv_estimator": "remax"}, "does not support algorithm.adv_estimator=remax"),
])
def test_bad_splits_and_features_fail_at_start_up(world, over, expect):
    with pytest.raises(ConfigError, match=expect):
        check_one_step_off(_cfg(**over), world)


def test_even_split_gives_half_the_world():
    assert check_one_step_off(_cfg(), 8) == 4
    assert check_one_step_off(_cfg(**{"parallel.rollout_ranks": 2, "rollout.tp": 2}), 4) == 2


@pytest.mark.parametrize("correction", [{"actor.rollout_is_decoupled": True, "actor.rollout_is": "token"},
                                        {"actor.use_decoupled_loss": True}])
def test_decoupled_corrections_satisfy_the_off_policy_check(correction):
    assert check_one_step_off(_cfg(**{"actor.tis_imp_ratio_cap": -1, **correction}), 4) == 2


def test_schedule_fresh_stopped_and_resumed():
    fresh = Schedule.of(0, 4, -1)
    assert fresh.last_batch == 4
    assert [fresh.batch_after(s) for s in (1, 2, 3, 4)] == [True, True, True, False]
    assert [fresh.weights_after(s) for s in (1, 2, 3, 4)] == [True, True, False, False]
    assert [Schedule.version_of(j) for j in (1, 2, 3, 4)] == [0, 0, 1, 2]
    # Stopped after 2 steps: B_3 is still generated, so checkpoint 2 can hold it; theta_2 is not shipped.
    stopped = Schedule.of(0, 4, 2)
    assert (stopped.last_step, stopped.last_batch) == (2, 3)
    assert stopped.batch_after(2) and not stopped.weights_after(2)
    resumed = Schedule.of(2, 4, -1)
    assert (resumed.start, resumed.last_step, resumed.last_batch) == (2, 4, 4)
    assert Schedule.of(4, 4, -1).idle


def test_offpolicy_metrics_values():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rollout = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.1, 0.1]]))
    same = offpolicy_metrics(rollout, rollout, mask, cap=2.0)
    assert same["async/is_weight_mean"] == pytest.approx(1.0) and same["async/mismatch_kl"] == pytest.approx(0.0)
    assert same["async/is_capped_frac"] == 0.0
    # Weights 1.5, 3 (capped at 2) and 0.5 on the three response tokens; the padded token is ignored.
    old = rollout + torch.log(torch.tensor([[1.5, 3.0, 100.0], [0.5, 1.0, 1.0]]))
    m = offpolicy_metrics(old, rollout, mask, cap=2.0)
    w = torch.tensor([1.5, 3.0, 0.5])
    assert m["async/is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert m["async/is_weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["async/is_capped_frac"] == pytest.approx(1 / 3)
    assert m["async/mismatch_kl"] == pytest.approx(float((w - 1 - w.log()).mean()), rel=1e-5)
    assert m["async/mismatch_kl"] > 0 and not math.isnan(m["async/mismatch_kl"])
