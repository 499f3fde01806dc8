"""grpo_passk and gpg: hand-derived values, degenerate groups, masks."""

from __future__ import annotations

import pytest
import torch

from rlhf.algos.advantages import get_adv_estimator


def _rewards(scores, T=3, lengths=None):
    """Outcome rewards on the last token of each response ([B, T]) and the response mask."""
    B = len(scores)
    lengths = lengths or [T] * B
    r = torch.zeros(B, T)
    m = torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        r[i, n - 1] = s
        m[i, :n] = 1
    return r, m


def test_grpo_passk_reinforces_only_the_best_by_its_margin():
    # group 0: scores 1, 0, 0.5 (best row 0, runner-up 0.5); group 1: 0, 0 (tie: margin 0)
    r, m = _rewards([1.0, 0.0, 0.5, 0.0, 0.0], lengths=[3, 2, 1, 3, 3])
    fn = get_adv_estimator("grpo_passk")
    adv, ret = fn(token_level_rewards=r, response_mask=m, index=[0, 0, 0, 1, 1], norm_adv_by_std_in_grpo=False)
    expected = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, expected[:, None] * m) and torch.equal(adv, ret)
    std0 = torch.tensor([1.0, 0.0, 0.5]).std()  # unbiased, as torch.std / verl
    adv, _ = fn(token_level_rewards=r, response_mask=m, index=[0, 0, 0, 1, 1])
    assert adv[0, 0].item() == pytest.approx(0.5 / (std0.item() + 1e-6), rel=1e-6)
    assert adv[1:].abs().sum() == 0


def test_grpo_passk_ties_pick_the_first_and_groups_of_one_are_refused():
    r, m = _rewards([1.0, 1.0, 0.0])
    adv, _ = get_adv_estimator("grpo_passk")(token_level_rewards=r, response_mask=m, index=[7, 7, 7],
                                            norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == [0.0, 0.0, 0.0]  # best 1 vs runner-up 1: margin 0
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        get_adv_estimator("grpo_passk")(token_level_rewards=r, response_mask=m, index=[0, 0, 1])


def test_gpg_scales_centred_scores_by_batch_over_nonzero():
    # B = 4, non-zero scores: 2 -> alpha = 2; group means 0.5 and 0.5
    r, m = _rewards([1.0, 0.0, 0.0, 1.0], lengths=[3, 1, 2, 3])
    adv, _ = get_adv_estimator("gpg")(token_level_rewards=r, response_mask=m, index=[0, 0, 1, 1])
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None] * m)
    # constant groups get 0; the global count comes from global_sum (here: as if a second rank
    # held 4 more samples, 2 of them non-zero -> alpha = 8 / 4 = 2 as well, then 8 / 2 = 4)
    r, m = _rewards([1.0, 1.0, 0.0, 1.0])
    adv, _ = get_adv_estimator("gpg")(token_level_rewards=r, response_mask=m, index=[0, 0, 1, 1],
                                      global_sum=lambda t: t + torch.tensor([4.0, -1.0], dtype=t.dtype))
    assert adv[:2].abs().sum() == 0
    assert torch.allclose(adv[2:, 0], torch.tensor([-0.5, 0.5]) * 4)


def test_unknown_estimator_lists_every_name():
    with pytest.raises(ValueError) as e:
        get_adv_estimator("grpo_pass_k")
    for name in ("gae", "grpo", "grpo_passk", "gpg", "rloo", "opo", "remax", "reinforce_plus_plus"):
        assert name in str(e.value)
