"""Every algorithm selectable from yaml runs end to end (tiny random model, 2 steps).

All runs share one interpreter (tests/e2e/_entry_driver.py): 26 separate ones cost ~5 s each just
importing torch and transformers."""

from __future__ import annotations

import math

import pytest

from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import PARITY_REWARD, grpo_args, run_script_many
from tests.unit.test_docs_reference import assert_documented


CASES = {
    "grpo": {},
    "dr_grpo": {"algorithm.norm_adv_by_std_in_grpo": False, "actor.loss_agg_mode": "seq-mean-token-sum-norm"},
    # rloo also runs AReaL's decoupled PPO with rejection sampling and the veto (rlhf/algos/rollout_corr.py)
    "rloo": {"algorithm.adv_estimator": "rloo", "actor.use_decoupled_loss": True, "actor.behav_imp_weight_cap": 5.0,
             "actor.rollout_rs": "token_k1,seq_max_k2", "actor.rollout_rs_threshold": "0.2_5.0,2.0",
             "actor.rollout_token_veto_threshold": 1e-4},
    "reinforce_plus_plus": {"algorithm.adv_estimator": "reinforce_plus_plus", "actor.use_kl_loss": True},
    # ... and verl's decoupled sequence-level IS weights, batch-normalised
    "reinforce_plus_plus_baseline": {"algorithm.adv_estimator": "reinforce_plus_plus_baseline",
                                     "actor.rollout_is_decoupled": True, "actor.rollout_is": "sequence",
                                     "actor.rollout_is_batch_normalize": True, "actor.rollout_rs": "geometric",
                                     "actor.rollout_rs_threshold": 2.0},
    "remax": {"algorithm.adv_estimator": "remax"},
    "opo": {"algorithm.adv_estimator": "opo"},
    "gspo": {"actor.policy_loss": "gspo", "actor.loss_agg_mode": "seq-mean-token-mean"},
    "kl_in_reward": {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive"},
    "grpo_passk": {"algorithm.adv_estimator": "grpo_passk"},
    "gpg": {"algorithm.adv_estimator": "gpg", "actor.policy_loss": "gpg"},
    "clip_cov": {"actor.policy_loss": "clip_cov", "actor.clip_cov_ratio": 0.05, "actor.clip_cov_lb": 0.0},
    "kl_cov": {"actor.policy_loss": "kl_cov", "actor.kl_cov_ratio": 0.05},
    "cispo": {"actor.policy_loss": "cispo", "actor.clip_ratio_high": 4.0},
    "geo_mean": {"actor.policy_loss": "geo_mean", "actor.loss_agg_mode": "seq-mean-token-mean"},
    "sapo": {"actor.policy_loss": "sapo", "actor.loss_agg_mode": "seq-mean-token-mean"},
    "dro": {"actor.policy_loss": "dro", "actor.dro_beta": 0.5},
    "dppo_kl": {"actor.policy_loss": "dppo_kl"},
    "dppo_tv": {"actor.policy_loss": "dppo_tv"},
    "bypass_mode": {"actor.policy_loss": "bypass_mode", "actor.rollout_correction_loss_type": "reinforce"},
    "token_sum_entropy_schedule": {"actor.loss_agg_mode": "token-sum", "actor.entropy_coeff": 0.01,
                                   "actor.entropy_coeff_schedule": "linear"},
    "gdpo": {"algorithm.adv_estimator": "gdpo", "algorithm.gdpo_reward_keys": ["acc", "short"],
             "algorithm.gdpo_reward_weights": [1.0, 0.5]},
    "optimal_token_baseline": {"algorithm.adv_estimator": "optimal_token_baseline"},
    "tir_optimal_token_baseline": {"algorithm.adv_estimator": "tir_optimal_token_baseline",
                                   "actor.policy_loss": "bypass_mode"},
    "dapo": {"algorithm.filter_groups.enable": True, "data.gen_batch_size": 8, "actor.clip_ratio_high": 0.28,
             "reward.overlong_buffer_enable": True, "reward.overlong_buffer_len": 4, "rollout.n": 4},
}


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    d = tmp_path_factory.mktemp("algorithms")
    (d / "parity_reward.py").write_text(PARITY_REWARD)
    args = [grpo_args(tiny_assets, d / name, **{"reward.reward_fn": f"{d / 'parity_reward.py'}:parity",
                                                "data.val_files": "", **over}) for name, over in CASES.items()]
    return d, dict(zip(CASES, run_script_many("train_grpo.py", args, timeout=1800)))


@pytest.mark.parametrize("name", list(CASES))
def test_algorithm_runs(name, runs):
    d, results = runs
    r = results[name]
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(d / name / "metrics.jsonl") if "actor/loss" in m]
    assert [m["step"] for m in rows] == [1, 2]
    assert_documented(k for m in read_metrics(d / name / "metrics.jsonl") for k in m)  # docs/reference/metrics.txt
    for m in rows:
        assert math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0
        low = -1.0 if name == "dapo" else 0.0  # the overlong penalty can reach -penalty_factor
        assert low <= m["reward/mean"] <= 1.0 + 1e-6
    assert "actor/cov_logp_adv" in rows[0] and "actor/entropy_coeff" in rows[0]
    if name in ("clip_cov", "kl_cov"):
        assert all(m["actor/cov_selected_frac"] > 0 for m in rows)
    if name == "token_sum_entropy_schedule":  # linear from 0.01 to 0 over the 2 steps
        assert [m["actor/entropy_coeff"] for m in rows] == pytest.approx([0.01, 0.0])
    assert all(math.isfinite(m["mismatch/kl"]) and math.isfinite(m["mismatch/ppl_ratio"]) for m in rows)
    if name in ("rloo", "reinforce_plus_plus_baseline"):  # the corrections ran (fp32 sampler ~ trainer)
        assert all(m["mismatch/rejected_frac"] < 0.5 and m["mismatch/is_weight_mean"] > 0 for m in rows)
    if name == "reinforce_plus_plus_baseline":
        assert all(m["mismatch/is_batch_norm_factor"] == pytest.approx(1.0, abs=0.1) for m in rows)
    if name == "remax":
        assert "reward/remax_baseline_mean" in rows[0]
    if name == "kl_in_reward":
        assert "kl_penalty/coef" in rows[0] and rows[1]["kl_penalty/coef"] != pytest.approx(0.001, abs=0)
    if name == "dapo":
        assert all(m["dynamic_sampling/kept_groups"] >= 8 for m in rows)
        assert sum(m["dynamic_sampling/filtered_groups"] for m in rows) > 0
        assert "reward/overlong_penalty" in rows[0]
