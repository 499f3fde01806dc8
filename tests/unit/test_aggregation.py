"""Masked reductions and layout-invariant loss aggregation (rlhf.algos.masked / aggregation)."""

import pytest
import torch

from rlhf.algos.aggregation import LOSS_AGG_MODES, AggNorm, agg_loss
from rlhf.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

# loss rows [1, 2, 3] (3 tokens) and [4, 5, (pad)] (2 tokens)
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


# ----------------------------------------------------------------------------- masked helpers


def test_masked_sum_mean_ignore_padding_even_nan():
    loss = LOSS.clone()
    loss[1, 2] = float("nan")  # padding may hold anything
    assert masked_sum(loss, MASK).item() == pytest.approx(15.0)
    assert masked_mean(loss, MASK).item() == pytest.approx(3.0)  # 15 / 5
    # per-row: [6/3, 9/2]
    torch.testing.assert_close(masked_mean(loss, MASK, dim=-1), torch.tensor([2.0, 4.5]))


def test_masked_var_and_whiten():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, squared deviations 1, 0, 1 -> biased 2/3, unbiased (x 3/2) 1
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    w = masked_whiten(values, mask)
    torch.testing.assert_close(w[0, :3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    # shift_mean=False keeps the mean (2): [1, 2, 3]
    w2 = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(w2[0, :3], torch.tensor([1.0, 2.0, 3.0]), atol=1e-6, rtol=0)


def test_masked_var_rejects_single_element():
    with pytest.raises(ValueError, match="one element"):
        masked_var(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]]))


# ----------------------------------------------------------------------------- agg_loss values


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 15 / 5),  # all tokens equal weight
        ("seq-mean-token-sum", (6 + 9) / 2),
        ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 2),  # 3.25
        ("seq-mean-token-sum-norm", (6 + 9) / (2 * 3)),  # Dr.GRPO: / (N_seq * L_max), L_max = T = 3
    ],
)
def test_agg_loss_local_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 15 / 10),
        ("seq-mean-token-sum", 15 / 4),
        ("seq-mean-token-mean", 6.5 / 4),
        ("seq-mean-token-sum-norm", 15 / (4 * 6)),
    ],
)
def test_agg_loss_with_global_norm(mode, expected):
    # This batch is one part of a mini-batch with 10 tokens, 4 sequences, horizon 6.
    norm = AggNorm(global_tokens=10, global_seqs=4, max_response_len=6)
    assert agg_loss(LOSS, MASK, mode, norm).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_rows_do_not_change_the_loss(mode):
    loss = torch.cat([LOSS, torch.full((1, 3), 7.0)])
    mask = torch.cat([MASK, torch.zeros(1, 3)])
    assert agg_loss(loss, mask, mode).item() == pytest.approx(agg_loss(LOSS, MASK, mode).item())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_zero_with_graph(mode):
    loss = torch.ones(2, 3, requires_grad=True)
    out = agg_loss(loss, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm.*token-sum"):
        agg_loss(LOSS, MASK, "token-avg")


def test_token_sum_is_the_unnormalised_sum_and_splits_exactly():
    assert torch.allclose(agg_loss(LOSS, MASK, "token-sum"), (LOSS * MASK).sum())
    parts = agg_loss(LOSS[:1], MASK[:1], "token-sum") + agg_loss(LOSS[1:], MASK[1:], "token-sum")
    assert torch.allclose(parts, agg_loss(LOSS, MASK, "token-sum"))


def test_aggnorm_from_masks_counts_tokens_and_nonempty_seqs():
    parts = [MASK, torch.tensor([[1.0, 0.0], [0.0, 0.0]])]  # parts may differ in T
    norm = AggNorm.from_masks(parts, max_response_len=8)
    assert norm == AggNorm(global_tokens=6.0, global_seqs=3.0, max_response_len=8)
    assert AggNorm.from_masks(MASK, 3) == AggNorm(5.0, 2.0, 3)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_sum_equals_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    loss = torch.randn(B, T, generator=g)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    full = agg_loss(loss, mask, mode)
    norm = AggNorm.from_masks(mask, max_response_len=T)
    parts = []
    for rows in torch.arange(B).chunk(4):
        # Trim each micro-batch to its own longest response, as a padding-free batcher would.
        t_max = max(int(lengths[rows].max()), 1)
        parts.append(agg_loss(loss[rows, :t_max], mask[rows, :t_max], mode, norm))
    torch.testing.assert_close(torch.stack(parts).sum(), full)
