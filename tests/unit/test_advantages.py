"""Advantage estimators (rlhf.algos.advantages), hand-derived numbers."""

import math

import pytest
import torch

from rlhf.algos.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    get_adv_estimator,
    register_adv_estimator,
)

EPS = 1e-6


def outcome(scores, lengths, T):
    """Token-level rewards with each score on the last valid token, and the mask."""
    B = len(scores)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
    return rewards, mask


def seq_adv(adv, mask):
    """The per-sequence advantage (value on the first token) and check it is constant over the mask."""
    first = adv[:, 0]
    torch.testing.assert_close(adv, first[:, None] * mask)
    return first


# Group 0: scores [1, 0, 2] (lengths 3, 3, 2); group 1: a single sample with score 5;
# group 2: [3, 3] all equal.
SCORES = [1.0, 0.0, 2.0, 5.0, 3.0, 3.0]
LENGTHS = [3, 3, 2, 3, 1, 2]
INDEX = torch.tensor([10, 10, 10, 7, 4, 4])


def test_grpo_hand_values_and_degenerate_groups():
    r, m = outcome(SCORES, LENGTHS, 3)
    adv, ret = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=INDEX)
    # group 0: mean 1, unbiased std sqrt(((0)^2 + 1 + 1) / 2) = 1 -> (s - 1) / (1 + eps)
    # group 1 (one sample): mean 0, std 1 -> 5 / (1 + eps), as verl
    # group 2 (all equal): 0
    expected = torch.tensor([0.0, -1.0, 1.0, 5.0, 0.0, 0.0]) / (1 + EPS)
    torch.testing.assert_close(seq_adv(adv, m), expected)
    assert torch.equal(adv, ret)


def test_grpo_std_normalisation_non_unit_std():
    # scores [0, 1, 1, 1]: mean 0.75, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    r, m = outcome([0.0, 1.0, 1.0, 1.0], [2, 2, 1, 2], 2)
    adv, _ = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(seq_adv(adv, m), torch.tensor([-0.75, 0.25, 0.25, 0.25]) / (0.5 + EPS))


def test_dr_grpo_mean_only():
    r, m = outcome(SCORES, LENGTHS, 3)
    adv, _ = get_adv_estimator("grpo")(
        token_level_rewards=r, response_mask=m, index=INDEX, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(seq_adv(adv, m), torch.tensor([0.0, -1.0, 1.0, 5.0, 0.0, 0.0]))


def test_grpo_equal_rewards_give_exact_zero():
    # 0.1 is not representable; mean(0.1, 0.1, 0.1) may differ from 0.1 by an ulp, which
    # divided by eps would be noise of order 1e-2. Must be exactly zero.
    r, m = outcome([0.1, 0.1, 0.1], [1, 1, 1], 1)
    adv, _ = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=[0, 0, 0])
    assert torch.equal(adv, torch.zeros(3, 1))


def test_grpo_string_index_matches_int_index():
    r, m = outcome(SCORES, LENGTHS, 3)
    fn = get_adv_estimator("grpo")
    a_int, _ = fn(token_level_rewards=r, response_mask=m, index=INDEX)
    a_str, _ = fn(token_level_rewards=r, response_mask=m, index=["u10", "u10", "u10", "u7", "u4", "u4"])
    torch.testing.assert_close(a_int, a_str)


def test_grpo_matches_per_group_loop_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 24, 5
    r = torch.randn(B, T, generator=g)
    m = (torch.rand(B, T, generator=g) > 0.3).float()
    index = torch.randint(0, 7, (B,), generator=g)
    adv, _ = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=index)
    scores = (r * m).sum(-1)  # rewards on masked positions do not count (verl sums them; ours never has any)
    ref = torch.empty(B)
    for i in range(B):  # verl's per-sample loop
        grp = scores[index == index[i]]
        mean, std = (grp.mean(), grp.std()) if len(grp) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        ref[i] = (scores[i] - mean) / (std + EPS)
    torch.testing.assert_close(adv, ref[:, None] * m, rtol=1e-5, atol=1e-5)


def test_rloo_hand_values():
    r, m = outcome(SCORES, LENGTHS, 3)
    adv, ret = get_adv_estimator("rloo")(token_level_rewards=r, response_mask=m, index=INDEX)
    # group 0: s_i - mean(others): 1 - 1 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5
    # group of one keeps its score (verl); equal group -> 0
    torch.testing.assert_close(seq_adv(adv, m), torch.tensor([0.0, -1.5, 1.5, 5.0, 0.0, 0.0]))
    assert torch.equal(adv, ret)


def test_opo_length_weighted_baseline():
    r, m = outcome(SCORES, LENGTHS, 3)
    adv, _ = get_adv_estimator("opo")(token_level_rewards=r, response_mask=m, index=INDEX)
    # group 0 lengths [3, 3, 2]: b = (3*1 + 3*0 + 2*2) / 8 = 7/8
    # group of one: b = 0; group [3, 3] (lengths 1, 2): b = 3 -> 0
    torch.testing.assert_close(seq_adv(adv, m), torch.tensor([1 / 8, -7 / 8, 9 / 8, 5.0, 0.0, 0.0]))


def test_reinforce_plus_plus_returns_and_whitening():
    # returns with gamma=0.5, reward 2 on token 1, token 2 masked:
    # t=2: 0 (then reset), t=1: 2, t=0: 0 + 0.5 * 2 = 1
    r = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 1.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=r, response_mask=m, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 2.0, 0.0], [0.25, 0.5, 1.0]]))
    # whitening over the 5 valid returns [1, 2, .25, .5, 1]: mean 0.95
    vals = torch.tensor([1.0, 2.0, 0.25, 0.5, 1.0])
    mean, std = vals.mean(), vals.std()  # unbiased, as verl
    expected = torch.zeros(2, 3)
    expected[m.bool()] = (vals - mean) / torch.sqrt(std**2 + 1e-8)
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_reset_after_mask():
    # A reward beyond the mask must not leak into earlier tokens: t=2 value 7 is reset.
    r = torch.tensor([[1.0, 0.0, 7.0], [0.0, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    _, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=r, response_mask=m, gamma=1.0)
    torch.testing.assert_close(ret[0, :2], torch.tensor([1.0, 0.0]))


def test_reinforce_plus_plus_baseline():
    # scores: group a [1, 0, 2], group b [3, 3]; T = 1
    r = torch.tensor([[1.0], [0.0], [2.0], [3.0], [3.0]])
    m = torch.ones(5, 1)
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=r, response_mask=m, index=[0, 0, 0, 1, 1]
    )
    # centred [0, -1, 1, 0, 0]; batch mean 0, unbiased var 2/4 = 0.5 -> divide by sqrt(0.5)
    expected = torch.tensor([0.0, -1.0, 1.0, 0.0, 0.0]) / math.sqrt(0.5 + 1e-8)
    torch.testing.assert_close(adv[:, 0], expected)


def test_remax():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator("remax")(
        token_level_rewards=r, response_mask=m, reward_baselines=torch.tensor([0.25, 3.0])
    )
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.75], [-1.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(token_level_rewards=r, response_mask=m)


def test_gae_hand_values_returns():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72):
    # t=2: delta = 1 - 0.7 = 0.3;                A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03;       A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04;       A0 = 0.04 + 0.72 * 0.246 = 0.21712
    adv, ret = get_adv_estimator("gae")(token_level_rewards=r, response_mask=m, values=v, gamma=0.9, lam=0.8)
    raw = torch.tensor([0.21712, 0.246, 0.3])
    torch.testing.assert_close(ret[0], raw + v[0])
    torch.testing.assert_close(adv[0], (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8), rtol=1e-4, atol=1e-5)


def test_gae_gamma_lam_one_and_whitening():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = get_adv_estimator("gae")(token_level_rewards=r, response_mask=torch.ones(1, 3), values=v)
    # A_t = 1 - V_t = [.5, .4, .3], returns = 1; whitened: mean .4, unbiased std .1 -> [1, 0, -1]
    torch.testing.assert_close(ret, torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, -1.0]]), atol=1e-4, rtol=0)


def test_gae_skips_masked_tail():
    # reward 9 and value 0.3 at the masked token must not reach the valid tokens:
    # t=1: delta = 1 - 0.6 = 0.4 -> A1 = 0.4; t=0: delta = 0.6 - 0.5 = 0.1 -> A0 = 0.5
    r = torch.tensor([[0.0, 1.0, 9.0]])
    v = torch.tensor([[0.5, 0.6, 0.3]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    _, ret = get_adv_estimator("gae")(token_level_rewards=r, response_mask=m, values=v)
    torch.testing.assert_close(ret[0, :2], torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(token_level_rewards=r, response_mask=m)


def test_group_estimators_need_index():
    r, m = outcome([1.0, 0.0], [1, 1], 1)
    for name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="index"):
            get_adv_estimator(name)(token_level_rewards=r, response_mask=m)


def test_registry_uniform_signature_and_errors():
    assert set(ADV_ESTIMATOR_REGISTRY) >= {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo"
    }
    r, m = outcome(SCORES, LENGTHS, 3)
    kwargs = dict(
        token_level_rewards=r, response_mask=m, index=INDEX, values=torch.zeros_like(r),
        reward_baselines=torch.zeros(6), gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, epsilon=1e-6,
        old_log_probs=torch.full_like(r, -1.0), sum_pi_squared=torch.full_like(r, 0.5),
        teacher_log_probs=torch.full_like(r, -1.5),
    )
    for name, fn in ADV_ESTIMATOR_REGISTRY.items():
        # grpo_passk refuses groups of one (INDEX has one): pair the rows for it
        adv, ret = fn(**{**kwargs, "index": [0, 0, 1, 1, 2, 2]} if name == "grpo_passk" else kwargs)
        assert adv.shape == ret.shape == r.shape, name
    with pytest.raises(ValueError, match="grpo.*rloo|gae"):
        get_adv_estimator("ppo")


def test_register_custom_estimator():
    @register_adv_estimator("unit_test_zero")
    def zero(*, token_level_rewards, response_mask, **_):
        z = torch.zeros_like(token_level_rewards)
        return z, z

    try:
        assert get_adv_estimator("unit_test_zero") is zero
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("unit_test_zero")(lambda **_: None)
    finally:
        del ADV_ESTIMATOR_REGISTRY["unit_test_zero"]
