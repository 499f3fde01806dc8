"""GAE and the value loss on padded batches of uneven lengths, and the PPO trainer's global statistics.

Hand-derived numbers; complements tests/unit/test_advantages.py (single rows) and
tests/unit/test_value_loss.py (one row).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos.advantages import get_adv_estimator
from rlhf.algos.masked import masked_whiten
from rlhf.algos.value_loss import compute_value_loss, explained_variance
from rlhf.models.parallel import make_global_whiten
from rlhf.train.ppo_trainer import global_value_stats

# Row 0: 3 response tokens; row 1: 2. Padding holds garbage that must not leak.
REWARDS = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, -1.0, 7.0, 7.0]])
VALUES = torch.tensor([[0.5, 0.25, 0.5, 9.0], [0.2, 0.4, 3.0, 3.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_gae_two_rows_of_different_lengths_hand_values():
    # gamma = 1, lam = 0.5; the value after the last valid token is 0.
    # row 0: t2: d = 1 - .5 = .5, A = .5;  t1: d = .5 - .25 = .25, A = .25 + .5*.5 = .5
    #        t0: d = .25 - .5 = -.25, A = -.25 + .5*.5 = 0           returns A + V = [.5, .75, 1]
    # row 1: t1: d = -1 - .4 = -1.4, A = -1.4;  t0: d = .4 - .2 = .2, A = .2 - .7 = -.5
    #                                                                   returns = [-.3, -1]
    adv, ret = get_adv_estimator("gae")(token_level_rewards=REWARDS, response_mask=MASK, values=VALUES,
                                        gamma=1.0, lam=0.5)
    sel = MASK.bool()
    torch.testing.assert_close(ret[sel], torch.tensor([0.5, 0.75, 1.0, -0.3, -1.0]))
    # whitening over the 5 valid tokens of the batch: mean -0.18, unbiased var 2.548 / 4 = 0.637
    raw = torch.tensor([0.0, 0.5, 0.5, -0.5, -1.4])
    torch.testing.assert_close(adv[sel], (raw + 0.18) / math.sqrt(0.637 + 1e-8), rtol=1e-5, atol=1e-6)


def test_gae_discount_across_rows():
    # gamma = 0.5, lam = 1: A_t = sum_k 0.5^k r_{t+k} - V_t (telescoping), per row
    adv, ret = get_adv_estimator("gae")(token_level_rewards=REWARDS, response_mask=MASK, values=VALUES,
                                        gamma=0.5, lam=1.0)
    sel = MASK.bool()
    # row 0 returns: [0.25, 0.5, 1]; row 1: [-0.5, -1]
    torch.testing.assert_close(ret[sel], torch.tensor([0.25, 0.5, 1.0, -0.5, -1.0]))


def test_global_whiten_equals_local_whiten_on_one_rank():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g)
    mask = (torch.arange(9)[None] < torch.tensor([9, 3, 1, 7, 5, 2])[:, None]).float()
    x = torch.where(mask.bool(), x, torch.full_like(x, float("inf")))  # padding garbage
    out = make_global_whiten()(x, mask)
    torch.testing.assert_close(out[mask.bool()], masked_whiten(x, mask)[mask.bool()], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        make_global_whiten()(x[:1, :1], mask[:1, :1])


def test_global_value_stats_match_explained_variance():
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(5, 7, generator=g)
    values = returns + 0.5 * torch.randn(5, 7, generator=g)
    mask = (torch.arange(7)[None] < torch.tensor([7, 1, 4, 6, 2])[:, None]).float()
    stats = global_value_stats(values * mask, returns, mask)
    assert stats["critic/vf_explained_var"] == pytest.approx(float(explained_variance(values, returns, mask)),
                                                             abs=1e-5)
    assert stats["critic/explained_variance"] == stats["critic/vf_explained_var"]
    assert stats["critic/returns/mean"] == pytest.approx(float(returns[mask.bool()].mean()), abs=1e-6)
    assert stats["critic/values/mean"] == pytest.approx(float(values[mask.bool()].mean()), abs=1e-6)
    assert global_value_stats(returns, returns, mask)["critic/vf_explained_var"] == pytest.approx(1.0)


VPREDS = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
OLD_V = torch.tensor([[1.0, 1.0, 9.0], [2.0, 9.0, 9.0]])
RETURNS = torch.tensor([[2.0, 2.0, 9.0], [1.0, 9.0, 9.0]])
VMASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [("token-mean", 0.5 * (1 + 0.25 + 4) / 3),
                                           ("seq-mean-token-mean", 0.5 * ((1 + 0.25) / 2 + 4) / 2),
                                           ("seq-mean-token-sum", 0.5 * ((1 + 0.25) + 4) / 2)])
def test_value_loss_padded_uneven_rows(mode, expected):
    # clip 0.5: row 0 t0: V_clip = 1, max(1, 1) = 1; t1: V_clip = 1.5, max(0, 0.25) = 0.25 (clipped);
    # row 1 t0: V_clip = 2.5, max(4, 2.25) = 4.
    loss, clipfrac = compute_value_loss(VPREDS, OLD_V, RETURNS, VMASK, cliprange_value=0.5, loss_agg_mode=mode)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    # an all-padding row (as micro-batching may add) changes nothing
    pad = lambda t, v: torch.cat([t, torch.full((1, 3), v)])  # noqa: E731
    loss_p, clip_p = compute_value_loss(pad(VPREDS, 5.0), pad(OLD_V, -3.0), pad(RETURNS, 8.0),
                                        pad(VMASK, 0.0), cliprange_value=0.5, loss_agg_mode=mode)
    assert loss_p.item() == pytest.approx(expected, abs=1e-6)
    assert clip_p.item() == pytest.approx(1 / 3)
