"""Clipped value loss and explained variance (rlhf.algos.value_loss)."""

import pytest
import torch

from rlhf.algos.aggregation import AggNorm
from rlhf.algos.value_loss import compute_value_loss, explained_variance

VPREDS = torch.tensor([[1.0, 0.0, 2.0, 50.0]])
VALUES = torch.tensor([[0.5, 0.5, 0.5, 0.0]])  # old values
RETURNS = torch.tensor([[2.0, 0.0, 0.0, -50.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_clipped_value_loss_hand_values():
    vpreds = VPREDS.clone().requires_grad_(True)
    loss, clipfrac = compute_value_loss(vpreds, VALUES, RETURNS, MASK, cliprange_value=0.2)
    # V_clip = clamp(V, 0.3, 0.7) = [0.7, 0.3, 0.7]
    # t0: (1-2)^2 = 1,  (0.7-2)^2 = 1.69 -> 1.69 (clipped term larger)
    # t1: 0,            (0.3-0)^2 = 0.09 -> 0.09 (clipped term larger)
    # t2: 4,            (0.7-0)^2 = 0.49 -> 4
    # 0.5 * (1.69 + 0.09 + 4) / 3 = 0.963333
    assert loss.item() == pytest.approx(0.5 * 5.78 / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    loss.backward()
    # gradient only through the unclipped max term (t2): 0.5 * 2 * (2 - 0) / 3 = 2/3
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.0, 2 / 3, 0.0]]))


def test_value_loss_no_clipping_with_large_range_and_global_norm():
    # cliprange huge -> plain 0.5 * MSE = 0.5 * (1 + 0 + 4) / 3
    loss, clipfrac = compute_value_loss(VPREDS, VALUES, RETURNS, MASK, cliprange_value=100.0)
    assert loss.item() == pytest.approx(0.5 * 5 / 3)
    assert clipfrac.item() == 0.0
    # as one part of a mini-batch with 10 tokens
    loss_g, _ = compute_value_loss(
        VPREDS, VALUES, RETURNS, MASK, cliprange_value=100.0, norm=AggNorm(10, 4, 4)
    )
    assert loss_g.item() == pytest.approx(0.5 * 5 / 10)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    # constant prediction: Var[R - c] = Var[R] -> 1 - 1.6667 / (1.6667 + 1e-5) ~ 0
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-4)
    # V = R - [1, -1, 1, -1]: Var[R - V] = 4/3, Var[R] = 5/3 -> 1 - 0.8 = 0.2
    values = returns - torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.2, abs=1e-4)
