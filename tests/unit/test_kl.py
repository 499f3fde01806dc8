"""KL estimators, controllers, KL-in-reward and entropy (rlhf.algos.kl)."""

import math

import pytest
import torch

from rlhf.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
)

# x = logprob - ref = [1, -1, log 0.5]
LOGP = torch.tensor([[0.0, -1.0, math.log(0.5)]])
REF = torch.tensor([[-1.0, 0.0, 0.0]])
X = [1.0, -1.0, math.log(0.5)]


@pytest.mark.parametrize("name", ["kl", "k1"])
def test_k1(name):
    torch.testing.assert_close(kl_penalty(LOGP, REF, name), torch.tensor([X]))


def test_abs():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "abs"), torch.tensor([[1.0, 1.0, math.log(2)]]))


@pytest.mark.parametrize("name", ["mse", "k2"])
def test_k2(name):
    expected = [0.5, 0.5, 0.5 * math.log(2) ** 2]  # 0.5 x^2
    torch.testing.assert_close(kl_penalty(LOGP, REF, name), torch.tensor([expected]))


@pytest.mark.parametrize("name", ["low_var_kl", "k3"])
def test_k3(name):
    # y = ref - logp = -x = [-1, 1, log 2]; k3 = e^y - y - 1
    expected = [math.exp(-1), math.e - 2, 2 - math.log(2) - 1]  # 0.3679, 0.7183, 0.3069
    torch.testing.assert_close(kl_penalty(LOGP, REF, name), torch.tensor([expected]))


def test_k3_clamped_to_10():
    out = kl_penalty(torch.tensor([[-30.0, 0.0]]), torch.tensor([[0.0, 0.0]]), "k3")
    torch.testing.assert_close(out, torch.tensor([[10.0, 0.0]]))


def test_unknown_kl_penalty():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "full")


def test_fixed_controller():
    c = get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(c, FixedKLController)
    c.update(current_kl=100.0, n_steps=1000)
    assert c.value == 0.05


def test_adaptive_controller_ziegler():
    c = get_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert isinstance(c, AdaptiveKLController)
    # KL 9: error 9/6 - 1 = 0.5 -> clipped 0.2; mult 1 + 0.2 * 1000 / 10000 = 1.02
    c.update(current_kl=9.0, n_steps=1000)
    assert c.value == pytest.approx(0.102)
    # KL 3: error -0.5 -> -0.2; mult 0.98
    c.update(current_kl=3.0, n_steps=1000)
    assert c.value == pytest.approx(0.102 * 0.98)
    # KL 6.6: error 0.1 (inside the band) -> mult 1.01
    c.update(current_kl=6.6, n_steps=1000)
    assert c.value == pytest.approx(0.102 * 0.98 * 1.01)
    state = c.state_dict()
    c2 = AdaptiveKLController(1.0, 6.0, 10000)
    c2.load_state_dict(state)
    assert c2.value == c.value


def test_controller_errors():
    with pytest.raises(ValueError, match="fixed, adaptive"):
        get_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=0)


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])  # k1 = old - ref; 9.0 is padding
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.5, kl_penalty="kl")
    # r = score - 0.5 * kl * mask
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])
    torch.testing.assert_close(rewards, expected)
    # per-sequence masked mean KL: [0.6 / 3, 0.9 / 2] = [0.2, 0.45]; batch mean 0.325
    assert set(metrics) == {"kl"}
    assert metrics["kl"].item() == pytest.approx(0.325)


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    # large logits: no overflow, near-deterministic -> ~0
    h = entropy_from_logits(torch.tensor([[1000.0, 0.0, 0.0]]))
    assert torch.isfinite(h).all() and h.item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
