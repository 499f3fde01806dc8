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


# ----------------------------------------------------------------------------- gdpo


def test_gdpo_normalises_each_reward_then_whitens_the_weighted_sum():
    # one group of 4, two rewards; GRPO on the sum (1, 1, 1, 1 + ...) would see format dominate
    fmt = torch.tensor([1.0, 1.0, 0.0, 0.0])
    acc = torch.tensor([1.0, 0.0, 1.0, 0.0])
    r, m = _rewards((fmt + acc).tolist(), T=2)
    fn = get_adv_estimator("gdpo")
    adv, ret = fn(token_level_rewards=r, response_mask=m, index=[0] * 4,
                  reward_components=torch.stack([fmt, acc], -1), reward_weights=[1.0, 2.0])
    # per reward: (x - 0.5) / (std=0.5774 + 1e-6) -> +-0.8660; weighted sum: f + 2a
    z = 0.5 / (torch.tensor([1.0, 1.0, 0.0, 0.0]).std().item() + 1e-6)
    combined = torch.tensor([z + 2 * z, z - 2 * z, -z + 2 * z, -z - 2 * z])
    tokens = combined.repeat_interleave(2)  # every row has 2 tokens
    expected = (combined - tokens.mean()) / (tokens.var() + 1e-8).sqrt()  # masked_whiten: unbiased var
    assert torch.allclose(adv, expected[:, None] * m, atol=1e-5) and torch.equal(adv, ret)
    assert adv[0, 0] > adv[2, 0] > adv[1, 0] > adv[3, 0]  # acc (weight 2) outranks format


def test_gdpo_without_components_is_whitened_grpo_and_checks_weights():
    r, m = _rewards([1.0, 0.0, 0.5, 2.0], lengths=[2, 3, 1, 3])
    idx = [0, 0, 1, 1]
    gdpo, _ = get_adv_estimator("gdpo")(token_level_rewards=r, response_mask=m, index=idx)
    grpo, _ = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=idx)
    from rlhf.algos.masked import masked_whiten
    assert torch.allclose(gdpo, masked_whiten(grpo, m) * m, atol=1e-6)
    with pytest.raises(ValueError, match="gdpo_reward_weights"):
        get_adv_estimator("gdpo")(token_level_rewards=r, response_mask=m, index=idx, reward_weights=[1.0, 1.0])


# ----------------------------------------------------------------------------- optimal token baseline


def _otb_inputs():
    # group 0: two rows of lengths 2 and 3; group 1: a single row of length 2
    r, m = _rewards([1.0, 0.0, 1.0], T=3, lengths=[2, 3, 2])
    lp = torch.log(torch.tensor([[0.5, 0.5, 1.0], [0.5, 1.0, 0.5], [0.5, 0.5, 1.0]]))
    s2 = torch.full((3, 3), 0.5)  # sum pi^2 at every step
    return r, m, lp, s2


def test_sum_pi_squared_from_logits():
    from rlhf.algos.optimal_token_baseline import sum_pi_squared_from_logits
    logits = torch.tensor([[0.0, 0.0], [0.0, float(torch.log(torch.tensor(3.0)))]])
    assert torch.allclose(sum_pi_squared_from_logits(logits), torch.tensor([0.5, 0.25 ** 2 + 0.75 ** 2]))


def test_optimal_token_baseline_hand_derived():
    r, m, lp, s2 = _otb_inputs()
    adv, ret = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r, response_mask=m, index=[0, 0, 1], old_log_probs=lp, sum_pi_squared=s2,
        handle_zero_tail=False, epsilon=0.0)
    # per-step energy 1 - 2 pi + 0.5: pi=0.5 -> 0.5, pi=1 -> -0.5
    # row 0: W = [0.5, 1.0], G = [1, 1]; row 1: W = [0.5, 0.0, 0.5], G = [0, 0, 0]
    # B_0 = (1*0.5 + 0) / (0.5 + 0.5) = 0.5; B_1 = (1*1.0 + 0) / (1.0 + 0.0) = 1; B_2 = 0 / 0.5 = 0
    assert torch.allclose(ret[0], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(adv[0], torch.tensor([0.5, 0.0, 0.0]))
    assert torch.allclose(adv[1], torch.tensor([-0.5, -1.0, 0.0]))
    assert torch.allclose(adv[2], torch.tensor([1.0, 1.0, 0.0]))  # group of one: A = G
    # zero tail: row 1 is the single longest; past step 2 (the runner-up's length) B = 0
    adv_t, _ = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r, response_mask=m, index=[0, 0, 1], old_log_probs=lp, sum_pi_squared=s2, epsilon=0.0)
    assert torch.allclose(adv_t, adv)  # G = 0 there, so unchanged here ...
    r2 = r.clone()
    r2[1, 2] = 2.0  # ... but with a reward at the tail the baseline matters
    a_tail, _ = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r2, response_mask=m, index=[0, 0, 1], old_log_probs=lp, sum_pi_squared=s2, epsilon=0.0)
    a_full, _ = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r2, response_mask=m, index=[0, 0, 1], old_log_probs=lp, sum_pi_squared=s2, epsilon=0.0,
        handle_zero_tail=False)
    assert a_tail[1, 2].item() == pytest.approx(2.0) and a_full[1, 2].item() == pytest.approx(0.0)


def test_optimal_token_baseline_is_weights_and_missing_inputs():
    r, m, lp, s2 = _otb_inputs()
    w = torch.ones(3, 3)
    w[1, 0] = 2.0  # row 1's first step energy x4: 2.0; B_0 = 0.5 / (0.5 + 2.0) = 0.2
    adv, _ = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r, response_mask=m, index=[0, 0, 1], old_log_probs=lp, sum_pi_squared=s2,
        rollout_is_weights=w, handle_zero_tail=False, epsilon=0.0)
    assert adv[0, 0].item() == pytest.approx(0.8)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        get_adv_estimator("optimal_token_baseline")(token_level_rewards=r, response_mask=m, index=[0, 0, 1])


def test_tir_variant_aligns_generated_tokens_across_holes():
    r, m, lp, s2 = _otb_inputs()
    kw = dict(index=[0, 0, 1], old_log_probs=lp, sum_pi_squared=s2, epsilon=0.0)
    a_otb, _ = get_adv_estimator("optimal_token_baseline")(token_level_rewards=r, response_mask=m, **kw)
    a_tir, _ = get_adv_estimator("tir_optimal_token_baseline")(token_level_rewards=r, response_mask=m, **kw)
    assert torch.allclose(a_otb, a_tir)  # contiguous masks: identical
    # row 1 with a tool-output hole at position 1: model tokens at 0 and 2 are its steps 0 and 1
    m2 = m.clone()
    m2[1] = torch.tensor([1.0, 0.0, 1.0])
    a, _ = get_adv_estimator("tir_optimal_token_baseline")(token_level_rewards=r, response_mask=m2, **kw)
    # compacted row 1: energy [0.5, 0.5+0.5=1.0], G = 0; row 0 as before: W = [0.5, 1.0], G = 1
    # B = [0.5, 0.5] -> row 0: [0.5, 0.5]; row 1 at positions 0 and 2: [-0.5, -0.5], hole 0
    assert torch.allclose(a[0], torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(a[1], torch.tensor([-0.5, 0.0, -0.5]))
