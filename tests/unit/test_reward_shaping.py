"""Reward shaping (overlong penalty, last-token placement) and DAPO group filtering."""

import pytest
import torch

from rlhf.algos.dynamic_sampling import select_informative_groups
from rlhf.algos.reward_shaping import overlong_reward_penalty, place_reward_on_last_token


def test_overlong_penalty_dapo_eq13():
    # L_max 20, L_cache 4: free up to 16, then -(len - 16) / 4 * f
    lengths = torch.tensor([10, 16, 17, 18, 20])
    out = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    half = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty(torch.tensor([1]), max_response_length=8, overlong_buffer_len=0, penalty_factor=1.0)
    with pytest.raises(ValueError, match="exceeds"):
        overlong_reward_penalty(torch.tensor([1]), max_response_length=8, overlong_buffer_len=9, penalty_factor=1.0)


def test_place_reward_on_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])  # row 3 has a hole
    out = place_reward_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.tensor([[0.0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 4, 0]])
    torch.testing.assert_close(out, expected)


def test_select_informative_groups():
    # group 0 mixed (keep), 1 constant (drop), 2 single sample (keep, as verl), 3 mixed (keep)
    index = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    metric = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0, 0.0, 0.0, 1.0])
    keep, kept, filtered = select_informative_groups(index, metric)
    assert keep.tolist() == [True, True, False, False, True, True, True, True]
    assert (kept, filtered) == (3, 1)
    # string uids work the same
    keep_s, _, _ = select_informative_groups(["a", "a", "b", "b", "c", "d", "d", "d"], metric)
    assert torch.equal(keep, keep_s)
