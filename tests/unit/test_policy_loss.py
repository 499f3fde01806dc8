"""Policy losses (rlhf.algos.policy_loss): hand values, clipping, TIS, layout invariance."""

import math

import pytest
import torch

from rlhf.algos.aggregation import LOSS_AGG_MODES, AggNorm
from rlhf.algos.policy_loss import POLICY_LOSS_REGISTRY, get_policy_loss

# One sequence, five valid tokens and one padding token (garbage values must not matter).
# token: a      b      c      d      e      pad
# A:    +1     +1     -1     -1     +1      +1
# r:    1.5    0.5    0.5    5.0    1.25    ?
RATIOS = [1.5, 0.5, 0.5, 5.0, 1.25, 100.0]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
OLD = torch.zeros(1, 6)


def new_log_prob(ratios=RATIOS):
    return torch.log(torch.tensor([ratios])).requires_grad_(True)


def vanilla(log_prob, **kw):
    args = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    args.update(kw)
    return get_policy_loss("vanilla")(OLD, log_prob, ADV, MASK, **args)


def test_vanilla_hand_values_clip_higher_and_dual_clip():
    lp = new_log_prob()
    loss, metrics = vanilla(lp)
    # eps_low 0.2, eps_high 0.28, c 3:
    # a: max(-1.5, -1.28) = -1.28      (clipped high)
    # b: max(-0.5, -0.8)  = -0.5
    # c: max(0.5, 0.8)    = 0.8        (clipped low), min(3, 0.8) = 0.8
    # d: max(5, 1.28)     = 5 -> dual clip min(3, 5) = 3
    # e: max(-1.25, -1.25) = -1.25     (1.25 < 1 + 0.28: not clipped)
    # token-mean = (-1.28 - 0.5 + 0.8 + 3 - 1.25) / 5 = 0.154
    assert loss.item() == pytest.approx(0.154, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)  # a, c
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)  # d
    assert metrics["clipfrac_high"].item() == pytest.approx(1 / 5)  # a
    assert metrics["clipfrac_low"].item() == pytest.approx(1 / 5)  # c
    ppo_kl = -sum(math.log(r) for r in RATIOS[:5]) / 5
    assert metrics["ppo_kl"].item() == pytest.approx(ppo_kl, abs=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())
    loss.backward()
    # d/dlogp (-A r) = -A r on unclipped tokens (b: -0.5, e: -1.25), 0 on clipped ones; / 5 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.1, 0.0, 0.0, -0.25, 0.0]]))


def test_clip_higher_asymmetry():
    # Same input, symmetric eps 0.2 (upper bound 1.2 instead of 1.28):
    # a (r = 1.5):  -1.28 -> -1.2   (+0.08)
    # e (r = 1.25): not clipped before, now -1.25 -> -1.2   (+0.05)
    # loss 0.154 + 0.13 / 5 = 0.18; clipped tokens a, c, e.
    loss_sym, m_sym = vanilla(new_log_prob(), clip_ratio_high=0.2)
    assert loss_sym.item() == pytest.approx(0.18, abs=1e-6)
    assert m_sym["pg_clipfrac"].item() == pytest.approx(3 / 5)
    # And a lower eps_low leaves c (r = 0.5) clipped at 0.9 instead of 0.8: +0.1 / 5.
    loss_low, _ = vanilla(new_log_prob(), clip_ratio_low=0.1)
    assert loss_low.item() == pytest.approx(0.154 + 0.02, abs=1e-6)


def test_dual_clip_bound_changes_loss_and_is_validated():
    # c = 4: token d contributes 4 instead of 3 -> 0.154 + 0.2
    loss, metrics = vanilla(new_log_prob(), clip_ratio_c=4.0)
    assert loss.item() == pytest.approx(0.354, abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        vanilla(new_log_prob(), clip_ratio_c=1.0)


def test_log_ratio_clamped_at_20():
    lp = torch.tensor([[30.0, -30.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    _, metrics = get_policy_loss("vanilla")(
        old, lp, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    assert metrics["ppo_kl"].item() == pytest.approx(0.0)  # mean(-20, +20)


def test_truncated_importance_sampling():
    lp = torch.zeros(1, 2, requires_grad=True)  # ratio 1: no PPO clipping
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 2.0]])
    # exp(old - rollout): token 0 -> 2 (capped to 1.5), token 1 -> 0.5
    rollout = torch.log(torch.tensor([[0.5, 2.0]]))
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    fn = get_policy_loss("vanilla")
    base, _ = fn(old, lp, adv, torch.ones(1, 2), **kw)
    assert base.item() == pytest.approx(-1.5)  # (-1 - 2) / 2
    loss, metrics = fn(old, lp, adv, torch.ones(1, 2), rollout_log_probs=rollout, tis_imp_ratio_cap=1.5, **kw)
    assert loss.item() == pytest.approx((-1 * 1.5 - 2 * 0.5) / 2)  # -1.25
    assert metrics["tis_imp_ratio_mean"].item() == pytest.approx(1.0)
    # cap <= 0 disables TIS even when rollout log-probs are given
    off, _ = fn(old, lp, adv, torch.ones(1, 2), rollout_log_probs=rollout, tis_imp_ratio_cap=-1, **kw)
    assert off.item() == pytest.approx(-1.5)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        fn(old, lp, adv, torch.ones(1, 2), tis_imp_ratio_cap=2.0, **kw)


def test_gspo_hand_values_and_gradient():
    # row 0: log ratios [0.2, 0.4] -> s = exp(0.3) = 1.35 > 1.2, A = +1 -> clipped: -1.2 per token
    # row 1: log ratios [-0.1, 0.1, 0.0] -> s = exp(0) = 1, A = -1 -> +1 per token
    # seq-mean-token-mean: (-1.2 + 1) / 2 = -0.1
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.2, 0.4, 5.0], [-0.1, 0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    fn = get_policy_loss("gspo")
    loss, metrics = fn(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    # GSPO gradient: d/dlogp_t [-A s_i] / (|y_i| G) = -A * s_i / (|y_i| * 2); row 1: 1 * 1 / 6
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]]))


def test_gspo_gradient_equals_sequence_objective():
    # Unclipped GSPO (huge clip range) = grad of -1/G sum_i A_i exp(mean_t(logp - old)).
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 4, generator=g) * 0.1
    lp = (old + torch.randn(3, 4, generator=g) * 0.1).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    a = torch.tensor([0.5, -1.0, 2.0])
    loss, _ = get_policy_loss("gspo")(old, lp, a[:, None].expand(3, 4), mask, clip_ratio_low=10, clip_ratio_high=10)
    loss.backward()
    lp2 = lp.detach().clone().requires_grad_(True)
    s = torch.exp(((lp2 - old) * mask).sum(-1) / mask.sum(-1))
    (-(a * s).mean()).backward()
    torch.testing.assert_close(loss, -(a * s).mean())
    torch.testing.assert_close(lp.grad, lp2.grad)


def test_unknown_policy_loss_lists_names():
    assert {"vanilla", "gspo"} <= set(POLICY_LOSS_REGISTRY)
    with pytest.raises(ValueError, match="gspo.*vanilla"):
        get_policy_loss("ppo2")


# ----------------------------------------------------------------------------- layout invariance


def _random_batch(B=8, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 0, 6, 2, 7, 3])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2
    log_prob = old + torch.randn(B, T, generator=g) * 0.3  # some tokens clip, some don't
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask + torch.randn(B, T, generator=g) * 0.1
    return old, log_prob, adv, mask, lengths


def _loss_and_grad(fn, old, log_prob, adv, mask, mode, norm, **kw):
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = fn(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, norm=norm, **kw)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("n_parts", [4, 2])  # 4 micro-batches; 2 halves = 2 dp ranks
def test_loss_and_grad_invariant_to_splitting(loss_name, mode, n_parts):
    fn = get_policy_loss(loss_name)
    old, log_prob, adv, mask, lengths = _random_batch()
    B, T = mask.shape
    full_loss, full_grad = _loss_and_grad(fn, old, log_prob, adv, mask, mode, None)

    norm = AggNorm.from_masks(mask, max_response_len=T)
    total = torch.zeros(())
    grad = torch.zeros(B, T)
    for rows in torch.arange(B).chunk(n_parts):
        # Trim each part to its longest response, as a padding-free micro-batcher would.
        t = max(int(lengths[rows].max()), 1)
        part_loss, part_grad = _loss_and_grad(
            fn, old[rows, :t], log_prob[rows, :t], adv[rows, :t], mask[rows, :t], mode, norm
        )
        total += part_loss
        grad[rows, :t] = part_grad
    torch.testing.assert_close(total, full_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad * mask, full_grad * mask, rtol=1e-5, atol=1e-7)
    assert full_grad.abs().sum() > 0  # the test would be vacuous otherwise
