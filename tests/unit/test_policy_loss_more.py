"""The verl losses beyond PPO-clip: hand-derived values and gradients, masks, uneven lengths."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos import get_policy_loss
from rlhf.algos.entropy_tools import covariance_from_sums, covariance_sums, entropy_coeff_at
from rlhf.algos.policy_loss import PolicyLossParams
from rlhf.algos.policy_loss_cov import select_cov_tokens

NEW = ["clip_cov", "kl_cov", "cispo", "gpg", "geo_mean", "sapo", "dro", "dppo_kl", "dppo_tv", "bypass_mode"]
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)


def _lp(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_gpg_loss_is_reinforce():
    lp = _lp([[-1.0, -2.0]])
    loss, m = get_policy_loss("gpg")(torch.zeros(1, 2, dtype=torch.float64), lp, torch.tensor([[1.0, -2.0]]).double(),
                                     torch.ones(1, 2))
    assert loss.item() == pytest.approx((1.0 - 4.0) / 2)  # mean of -A l = [1, -4]
    loss.backward()
    assert lp.grad.tolist() == [[-0.5, 1.0]]  # -A / N


def test_cispo_clips_the_weight_not_the_gradient():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    lp = _lp([[-1.0 + math.log(1.5), -1.0 + math.log(0.5)]])
    A = torch.ones(1, 2, dtype=torch.float64)
    loss, m = get_policy_loss("cispo")(old, lp, A, torch.ones(1, 2), **CLIP)
    expected = (-1.2 * lp[0, 0].item() - 0.8 * lp[0, 1].item()) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.6, -0.4])  # both tokens keep a gradient (PPO: 0 on the first)
    assert m["pg_clipfrac"].item() == 1.0


def test_dro_quadratic_penalty_gradient():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    lp = _lp([[-0.5, -1.0]])
    A = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    loss, _ = get_policy_loss("dro")(old, lp, A, torch.ones(1, 2), params=PolicyLossParams(dro_beta=2.0), **CLIP)
    loss.backward()
    # d/dl of -(A l - beta/2 (l - old)^2) = -(A - beta (l - old)), then / N = 2
    assert lp.grad[0].tolist() == pytest.approx([-(1 - 2 * 0.5) / 2, -(1 - 0) / 2])
    with pytest.raises(ValueError, match="dro_beta"):
        get_policy_loss("dro")(old, lp, A, torch.ones(1, 2), **CLIP)


def test_dppo_tv_masks_tokens_outside_the_probability_trust_region():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64))
    lp = _lp([[math.log(0.8), math.log(0.6), math.log(0.2)]])  # dp = +0.3, +0.1, -0.3
    A = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, m = get_policy_loss("dppo_tv")(old, lp, A, torch.ones(1, 3), **CLIP)
    # only token 1 is valid (0.3 > eps_high; -0.3 < -eps_low): L = -A min(r, 3) l / 3, r = 1.2
    assert loss.item() == pytest.approx(-1.2 * math.log(0.6) / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1.2 / 3, 0.0])


def test_dppo_kl_never_masks_a_token_moving_against_its_advantage():
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    lp = _lp([[math.log(0.05), math.log(0.95)]])  # huge binary KL both
    A = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    _, m = get_policy_loss("dppo_kl")(old, lp, A, torch.ones(1, 2), **CLIP)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)  # token 0 (p fell, A > 0) stays valid


def test_sapo_on_policy_gate_gives_the_policy_gradient():
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    lp = _lp([[-1.0, -2.0]])
    A = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = get_policy_loss("sapo")(old, lp, A, torch.ones(1, 2), loss_agg_mode="token-mean", **CLIP)
    # f(1; tau) = 4 / tau * sigmoid(0) = 2 / tau: L = mean(-2 A / tau) with tau 1.0 (A > 0), 1.05 (A < 0)
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.5, 0.5])  # f'(1) r = 1: gradient -A / N


def test_geo_mean_sequence_ratio_and_log_space_clip():
    old = torch.zeros(2, 2, dtype=torch.float64)
    lp = _lp([[0.1, -0.1], [0.6, 0.0]])
    A = torch.ones(2, 2, dtype=torch.float64)
    loss, m = get_policy_loss("geo_mean")(old, lp, A, torch.ones(2, 2), clip_ratio_low=0.4, clip_ratio_high=0.4)
    # row 0: exp(mean(0.1, -0.1)) = 1; row 1: 0.6 clipped to 0.4 -> exp(0.2); L = mean_i(-A R_i)
    assert loss.item() == pytest.approx((-1.0 - math.exp(0.2)) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(0.25)


def test_kl_cov_penalises_only_selected_tokens():
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = _lp([[0.1, 0.1, 0.1]])
    A = torch.ones(1, 3, dtype=torch.float64)
    sel = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    loss, m = get_policy_loss("kl_cov")(old, lp, A, torch.ones(1, 3), cov_select=sel, **CLIP)
    assert loss.item() == pytest.approx((-3 * math.exp(0.1) + 0.1 * 0.1) / 3)  # ppo_kl_coef 0.1 (verl)
    assert m["cov_selected_frac"].item() == pytest.approx(1 / 3)


def test_clip_cov_drops_selected_tokens_from_the_gradient():
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = _lp([[0.05, 0.05, 0.05]])
    A = torch.ones(1, 3, dtype=torch.float64)
    sel = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, _ = get_policy_loss("clip_cov")(old, lp, A, torch.ones(1, 3), cov_select=sel, **CLIP)
    loss.backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == pytest.approx(-math.exp(0.05) / 3)


def test_bypass_mode_uses_the_rollout_policy_as_old():
    roll = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-3.0, -3.0]], dtype=torch.float64)  # ignored in bypass mode
    lp = _lp([[-1.0 + math.log(3.0), -1.0]])
    A = torch.ones(1, 2, dtype=torch.float64)
    vanilla, _ = get_policy_loss("vanilla")(roll, lp, A, torch.ones(1, 2), **CLIP)
    bypass, _ = get_policy_loss("bypass_mode")(old, lp, A, torch.ones(1, 2), rollout_log_probs=roll, **CLIP)
    assert bypass.item() == pytest.approx(vanilla.item())
    lp2 = _lp([[-1.0 + math.log(3.0), -1.0]])
    loss, m = get_policy_loss("bypass_mode")(old, lp2, A, torch.ones(1, 2), rollout_log_probs=roll,
                                             params=PolicyLossParams(loss_type="reinforce"), **CLIP)
    # token IS weights min(r, 2): [2, 1]; L = mean(-w A l)
    assert loss.item() == pytest.approx((-2 * lp2[0, 0].item() - lp2[0, 1].item()) / 2)
    assert m["rollout_is_mean"].item() == pytest.approx(1.5)


@pytest.mark.parametrize("name", NEW)
def test_new_losses_respect_the_mask_and_split_over_micro_batches(name):
    """Padding never changes the loss, and two micro-batches with the global norm sum to the
    one-batch loss (the invariance the update relies on), with uneven lengths."""
    from rlhf.algos.aggregation import AggNorm

    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    mask = (torch.arange(T)[None] < torch.tensor([5, 2, 4, 1])[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5
    lp = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    roll = old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    params = PolicyLossParams(dro_beta=0.5, clip_cov_lb=-10.0, clip_cov_ub=10.0, clip_cov_ratio=0.2, kl_cov_ratio=0.2)
    sel = (select_cov_tokens(name, old, A, mask, params, covariance_sums(old, A, mask))
           if name in ("clip_cov", "kl_cov") else None)
    fn = get_policy_loss(name)
    mode = "seq-mean-token-mean" if name == "geo_mean" else "token-mean"
    norm = AggNorm(global_tokens=float(mask.sum()), global_seqs=float((mask.sum(-1) > 0).sum()), max_response_len=T)
    kw = dict(loss_agg_mode=mode, norm=norm, params=params, **CLIP)
    full, _ = fn(old, lp, A, mask, cov_select=sel, rollout_log_probs=roll, **kw)
    parts = sum(fn(old[r], lp[r], A[r], mask[r], cov_select=None if sel is None else sel[r], rollout_log_probs=roll[r],
                   **kw)[0] for r in (slice(0, 1), slice(1, 4)))
    assert torch.allclose(full, parts, atol=1e-12), (full, parts)
    junk = torch.where(mask.bool(), lp, torch.full_like(lp, 7.0))
    again, _ = fn(old, junk, A, mask, cov_select=sel, rollout_log_probs=roll, **kw)
    assert torch.allclose(full, again, atol=1e-12)


def test_select_cov_tokens_picks_the_largest_covariance():
    A = torch.tensor([[1.0, -1.0, 2.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-0.5, -2.0, -0.1, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    # means: A 0.5, l -0.9; cov = (A - .5)(l + .9) = [0.2, 1.65, 1.2, -0.05]
    sums = covariance_sums(old, A, mask)
    sel = select_cov_tokens("kl_cov", old, A, mask, PolicyLossParams(kl_cov_ratio=0.5), sums)
    assert sel.tolist() == [[0.0, 1.0, 1.0, 0.0]]  # n = int(0.5 * 4) = 2 largest
    sel = select_cov_tokens("clip_cov", old, A, mask, PolicyLossParams(clip_cov_ratio=0.9, clip_cov_lb=1.0,
                                                                       clip_cov_ub=1.5), sums)
    assert sel.tolist() == [[0.0, 0.0, 1.0, 0.0]]  # the one candidate in (1, 1.5)


def test_entropy_schedule_and_covariance():
    assert entropy_coeff_at(0, 11, 0.01, 0.0, "linear") == pytest.approx(0.01)
    assert entropy_coeff_at(5, 11, 0.01, 0.0, "linear") == pytest.approx(0.005)
    assert entropy_coeff_at(10, 11, 0.01, 0.0, "cosine") == pytest.approx(0.0)
    assert entropy_coeff_at(5, 11, 0.01, 0.0, "cosine") == pytest.approx(0.005)
    assert entropy_coeff_at(7, 11, 0.01, 0.0, "constant") == 0.01
    with pytest.raises(ValueError, match="constant, linear|constant"):
        entropy_coeff_at(0, 1, 0.1, 0.0, "exp")
    lp = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    A = torch.tensor([[1.0, 1.0, 4.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # masked: l = 1,2,3; A = 1,1,4: E[Al] = 5, E[A] E[l] = 2 * 2 -> cov 1
    assert covariance_from_sums(covariance_sums(lp, A, mask)) == pytest.approx(1.0)


def test_unknown_loss_lists_every_name():
    with pytest.raises(ValueError) as e:
        get_policy_loss("clipcov")
    for name in NEW + ["vanilla", "gspo"]:
        assert name in str(e.value)
