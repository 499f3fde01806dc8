"""Training-health alerts: absolute thresholds, spikes against the recent median, config errors."""

from __future__ import annotations

import pytest

from rlhf.config.load import load_config
from rlhf.ops.alerts import HealthMonitor
from rlhf.schema.config import ConfigError


def test_absolute_alerts_fire_on_their_side_of_the_threshold():
    lines = []
    mon = HealthMonitor({"kl_to_ref": 0.5, "entropy_collapse": 0.1, "logprob_diff": 2.0}, warn=lines.append)
    out = mon.check(1, {"actor/kl_to_ref": 0.4, "actor/entropy": 0.2, "rollout/logprob_diff_max": 2.5})
    assert out == {"alerts/kl_to_ref": 0.0, "alerts/entropy_collapse": 0.0, "alerts/logprob_diff": 1.0}
    assert lines == ["[rlhf] alert at step 1: rollout/logprob_diff_max = 2.5 > 2 (trainer.alerts.logprob_diff)"]
    out = mon.check(2, {"kl_penalty/kl": 0.7, "actor/entropy": 0.05})  # kl_penalty/kl stands in for kl_to_ref
    assert out == {"alerts/kl_to_ref": 1.0, "alerts/entropy_collapse": 1.0}


def test_relative_alerts_need_history_and_compare_with_the_recent_median():
    mon = HealthMonitor({"grad_norm_spike": 5.0, "response_length_collapse": 0.5}, min_history=3)
    first = [mon.check(s, {"actor/grad_norm": 100.0, "response_length/mean": 1.0}) for s in range(2)]
    assert all(o == {"alerts/grad_norm_spike": 0.0, "alerts/response_length_collapse": 0.0} for o in first)
    for s, g in enumerate((1.0, 2.0, 1.5), start=2):  # history: 100, 100, 1, 2, 1.5 -> median 2
        mon.check(s, {"actor/grad_norm": g, "response_length/mean": 40.0})
    out = mon.check(9, {"actor/grad_norm": 10.5, "response_length/mean": 10.0})  # median length 40 (1,1,40,40,40)
    assert out == {"alerts/grad_norm_spike": 1.0, "alerts/response_length_collapse": 1.0}
    assert mon.check(10, {"actor/grad_norm": 9.0, "response_length/mean": 40.0})["alerts/grad_norm_spike"] == 0.0


@pytest.mark.parametrize("alerts, msg", [("{kl: 1.0}", "unknown alert 'kl'"),
                                         ("{kl_to_ref: -1}", "positive number")])
def test_bad_alert_config_is_one_line(alerts, msg):
    with pytest.raises(ConfigError, match=f"trainer.alerts.*{msg}"):
        load_config(None, ["model.path=m", "data.train_files=t.parquet", f"trainer.alerts={alerts}"])
