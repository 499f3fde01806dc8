"""pass@k / maj@k / per-source summaries on a fixed set of generations, against hand-computed values."""

from math import comb

import pytest

from rlhf.config.load import load_config
from rlhf.schema.config import ConfigError
from rlhf.train.evaluation import (
    SampleRecord,
    flat_metrics,
    format_table,
    ks_for,
    maj_at_k,
    pass_at_k,
    records_from_scores,
    summarize,
    val_sampling,
)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(16, 4, 8) == pytest.approx(1 - 495 / 12870)  # C(12,8) = 495, C(16,8) = 12870
    assert pass_at_k(16, 4, 8) == pytest.approx(1 - comb(12, 8) / comb(16, 8))
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0  # n - c < k: certain
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1 is the fraction correct
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_maj_at_k_groups_and_ties():
    preds, accs = ["5", "3", "3", "5"], [1, 0, 0, 1]
    assert maj_at_k(preds, accs, 4) == 1.0  # 2-2 tie: the earliest answer ("5") wins
    assert maj_at_k(preds, accs, 2) == 0.5  # groups [5,3] -> 5 (right), [3,5] -> 3 (wrong)
    assert maj_at_k(preds, accs, 1) == 0.5
    assert maj_at_k(["4", "9", "9", "9"], [1, 0, 0, 0], 4) == 0.0  # the majority is wrong
    assert maj_at_k([None, None], [0, 0], 2) == 0.0
    assert maj_at_k([None, "2", "2"], [0, 1, 1], 3) == 1.0  # samples without an answer do not vote


def test_ks_for():
    assert ks_for(1) == [1] and ks_for(16) == [1, 2, 4, 8, 16] and ks_for(6) == [1, 2, 4, 6]


def _fixed_records():
    rows = [  # (key, source, acc, pred, length, truncated), 4 samples per prompt in sample order
        *[(0, "d1", a, p, 10, False) for a, p in zip([1, 0, 0, 1], ["5", "3", "3", "5"])],
        *[(1, "d1", a, p, 20, t) for a, p, t in zip([0, 0, 0, 0], ["2", "2", None, "7"], [0, 0, 1, 1])],
        *[(0, "d2", a, p, 30, False) for a, p in zip([1, 0, 0, 0], ["4", "9", "9", "9"])],
    ]
    return records_from_scores([r[0] for r in rows], [r[1] for r in rows], [float(r[2]) for r in rows],
                               [float(r[2]) for r in rows], [r[3] for r in rows], [r[4] for r in rows],
                               [bool(r[5]) for r in rows])


def test_summarize_fixed_generations():
    s = summarize(_fixed_records())
    d1, d2, a = s["d1"], s["d2"], s["all"]
    assert d1["n_prompts"] == 2 and d1["n_samples"] == 8
    assert d1["pass@1"] == pytest.approx(2 / 8)
    assert d1["pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert d1["pass@4"] == pytest.approx((1 + 0) / 2)
    assert d1["maj@1"] == pytest.approx((0.5 + 0) / 2)
    assert d1["maj@2"] == pytest.approx((0.5 + 0) / 2)
    assert d1["maj@4"] == pytest.approx((1 + 0) / 2)
    assert d1["response_length"] == 15 and d1["truncation_rate"] == pytest.approx(2 / 8)
    assert d2["pass@2"] == pytest.approx(0.5) and d2["pass@4"] == 1.0 and d2["maj@4"] == 0.0
    assert d2["maj@2"] == pytest.approx(0.5)  # [4,9] tie -> 4 (right), [9,9] -> 9 (wrong)
    # "all": three prompts (key 0 of d1 and key 0 of d2 stay distinct)
    assert a["n_prompts"] == 3 and a["pass@1"] == pytest.approx(3 / 12)
    assert a["pass@2"] == pytest.approx((5 / 6 + 0 + 0.5) / 3)
    assert a["pass@4"] == pytest.approx(2 / 3) and a["maj@4"] == pytest.approx(1 / 3)
    flat = flat_metrics(s, "val")
    assert flat["val/acc"] == pytest.approx(0.25) and flat["val/n"] == 12 and flat["val/d2/pass@4"] == 1.0
    assert flat["val/pass@4"] == pytest.approx(2 / 3) and flat["val/response_length"] == 20
    assert "d1: prompts=2 samples=8 pass@1=0.2500" in format_table(s)


def test_no_pred_means_no_maj():
    recs = records_from_scores([0, 0], ["g"] * 2, [1.0, 0.0], [1.0, float("nan")], [None, None], [3, 4], [0, 0])
    s = summarize(recs)["g"]
    assert "maj@1" not in s and s["pass@2"] == 1.0 and s["pass@1"] == 0.5
    assert [r.sample for r in recs] == [0, 1] and isinstance(recs[0], SampleRecord)


def _cfg(*overrides):
    return load_config(None, ["model.path=m", "data.train_files=t.parquet", *overrides])


def test_val_sampling_from_config():
    assert val_sampling(_cfg()) == {"n": 1, "temperature": 0.0}  # greedy by default
    assert val_sampling(_cfg("rollout.val_temperature=0.7")) == {"n": 1, "temperature": 0.7}  # legacy key
    vk = val_sampling(_cfg("trainer.val_kwargs.do_sample=true", "trainer.val_kwargs.n=8",
                           "trainer.val_kwargs.temperature=0.6", "trainer.val_kwargs.top_p=0.95"))
    assert vk == {"n": 8, "temperature": 0.6, "top_p": 0.95, "top_k": -1}
    with pytest.raises(ConfigError, match="trainer.val_kwargs.n.*greedy"):
        _cfg("trainer.val_kwargs.n=4")
    with pytest.raises(ConfigError, match="rollout.val_temperature.*not both"):
        _cfg("trainer.val_kwargs.do_sample=true", "rollout.val_temperature=0.5")


def test_reward_dict_extras_become_validation_metrics():
    from types import SimpleNamespace

    import torch

    from rlhf.rewards.scoring import ScoreResult
    from rlhf.train.evaluation import score_batch

    nan = float("nan")

    class Scorer:
        def score(self, texts, gts, sources, extras):
            return ScoreResult(torch.tensor([1.0, 0.0, 1.0, 0.0]), {"fmt": [1.0, 0.0, 1.0, nan], "len": [2.0] * 4})

    batch = SimpleNamespace(response_texts=["a"] * 4, ground_truths=["1"] * 4, data_sources=["d1", "d1", "d2", "d2"],
                            extra_infos=[None] * 4, index=torch.tensor([0, 1, 0, 1]),
                            response_mask=torch.ones(4, 3), truncated=torch.zeros(4, dtype=torch.bool),
                            trajectory_lengths=lambda: torch.full((4,), 3))
    flat = flat_metrics(summarize(score_batch(Scorer(), batch)), "val")
    assert flat["val/d1/reward/fmt"] == 0.5 and flat["val/d2/reward/fmt"] == 1.0  # NaN: not reported
    assert flat["val/reward/fmt"] == pytest.approx(2 / 3) and flat["val/reward/len"] == 2.0
