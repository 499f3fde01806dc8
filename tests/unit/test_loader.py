"""PromptLoader: deterministic order, exact resume, data-parallel shards."""

import pytest
import torch

from rlhf.data.loader import PromptLoader, shard


def _take(loader, k):
    return [loader.next_batch() for _ in range(k)]


def test_epoch_is_a_seeded_permutation():
    loader = PromptLoader(10, 3, seed=7)
    assert loader.steps_per_epoch == 3
    batches = list(loader)
    assert len(batches) == 3 and all(len(b) == 3 for b in batches)
    g = torch.Generator()
    g.manual_seed(7)
    expected = torch.randperm(10, generator=g).tolist()
    assert sum(batches, []) == expected[:9]
    # epoch 1 uses seed + 1
    g.manual_seed(8)
    assert sum(list(loader), []) == torch.randperm(10, generator=g).tolist()[:9]


def test_same_seed_same_order_different_seed_differs():
    a, b, c = PromptLoader(50, 5, seed=1), PromptLoader(50, 5, seed=1), PromptLoader(50, 5, seed=2)
    assert _take(a, 25) == _take(b, 25)
    assert _take(PromptLoader(50, 5, seed=1), 10) != _take(c, 10)


def test_no_shuffle_and_keep_last():
    loader = PromptLoader(7, 3, seed=0, shuffle=False, drop_last=False)
    assert loader.steps_per_epoch == 3
    assert list(loader) == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("k", [0, 2, 3, 4, 7])
def test_resume_continues_exactly(k):
    # 4 batches per epoch: k=3 stops right at the end of an epoch, k=7 in the second epoch
    uninterrupted = _take(PromptLoader(17, 4, seed=3), 12)
    first = PromptLoader(17, 4, seed=3)
    _take(first, k)
    state = first.state_dict()
    resumed = PromptLoader(17, 4, seed=3)
    resumed.load_state_dict(state)
    assert _take(resumed, 12 - k) == uninterrupted[k:]


def test_resume_mid_epoch_with_for_loop():
    full = PromptLoader(12, 2, seed=0)
    epochs = [list(full), list(full)]
    first = PromptLoader(12, 2, seed=0)
    it = iter(first)
    seen = [next(it), next(it)]
    resumed = PromptLoader(12, 2, seed=0)
    resumed.load_state_dict(first.state_dict())
    assert seen + list(resumed) == epochs[0]
    assert list(resumed) == epochs[1]


def test_resume_rejects_changed_setup():
    state = PromptLoader(20, 4, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        PromptLoader(20, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        PromptLoader(20, 5, seed=0).load_state_dict(state)


def test_shard_contiguous_and_covering():
    batch = [9, 4, 7, 1, 0, 3]
    assert shard(batch, 0, 3) == [9, 4]
    assert shard(batch, 2, 3) == [0, 3]
    assert sum((shard(batch, r, 2) for r in range(2)), []) == batch
    assert PromptLoader(6, 6, seed=0).shard(batch, 1, 2) == [1, 0, 3]


def test_shard_errors():
    with pytest.raises(ValueError, match="does not split evenly over dp_size=4"):
        shard(list(range(6)), 0, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        shard(list(range(6)), 2, 2)


def test_too_small_dataset():
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptLoader(3, 4, seed=0)
