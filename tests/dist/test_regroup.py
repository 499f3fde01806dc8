"""Dynamic sampling's regrouping on 2 gloo ranks (rlhf/train/regroup.py).

Each rank holds the kept groups of its generation batches (different counts per rank, one
group id kept on both ranks, one kept twice on one rank). The tensor-collective regrouping
must give every rank exactly the rows the previous pickled all-gather gave it (the reference
below is that code), which are the 1-rank batch's rows of that rank's groups.
"""

from __future__ import annotations

import dataclasses

import torch

from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import dist_device, run_distributed

KEEP, MINI, N = 6, 2, 2  # groups trained on, groups per mini-batch, samples per group


def _rank_batch(rank: int):
    """Rank 0 kept 4 groups, rank 1 kept 5 (group 13 on both; group 21 twice on rank 1)."""
    ids = {0: [10, 11, 12, 13], 1: [20, 13, 21, 22, 21]}[rank]
    b = random_rollout_batch(len(ids), N, 5, 6, 50, seed=rank)
    b.index = torch.tensor(ids).repeat_interleave(N)
    b.token_level_scores = torch.randn(len(b), 6, generator=torch.Generator().manual_seed(7 + rank))
    b.acc = (b.token_level_scores[:, 0] > 0).float()
    b.response_texts = [f"r{rank}-{i}" for i in range(len(b))]
    return b


def _reference(pieces, dp_rank: int, dp: int):
    """The pre-fix trainer code: every rank's whole batch pickled to every rank."""
    from rlhf.schema.batch import RolloutBatch, minibatch_major_shard

    merged = RolloutBatch.concat(pieces)
    groups = list(dict.fromkeys(merged.index.tolist()))[:KEEP]
    mine = set(minibatch_major_shard(groups, dp_rank, dp, MINI))
    order = {g: k for k, g in enumerate(groups)}
    rows = sorted((i for i, g in enumerate(merged.index.tolist()) if g in mine),
                  key=lambda i: (order[merged.index[i].item()], i))
    return merged.select(rows)


def _same(a, b) -> None:
    assert len(a) == len(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        else:
            assert (y is None) if x is None else isinstance(y, (torch.Tensor, list)), f.name


def _check(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from rlhf.schema.batch import RolloutBatch
    from rlhf.train.regroup import regroup_rows

    pieces = [_rank_batch(r) for r in range(world)]
    got = regroup_rows(pieces[rank].to(dist_device()), keep_groups=KEEP, dp_rank=rank, dp=world, mini_batch_size=MINI,
                       group=dist.group.WORLD)
    got = got.to(torch.device("cpu"))
    _same(got, _reference(pieces, rank, world))
    assert got.response_texts == []  # lists are the caller's to rebuild
    # The ranks' k-th mini-batches together are the 1-rank batch's k-th mini-batch.
    one = regroup_rows(RolloutBatch.concat(pieces), keep_groups=KEEP, dp_rank=0, dp=1, mini_batch_size=MINI)
    _same(one, _reference([RolloutBatch.concat(pieces)], 0, 1))
    torch.save({"got": got, "one": one}, f"{out}.rank{rank}")


def test_tensor_regrouping_equals_the_pickled_gather_and_one_rank(tmp_path):
    from rlhf.schema.batch import minibatch_major_shard

    run_distributed(_check, 2, str(tmp_path / "r"))
    res = [torch.load(f"{tmp_path / 'r'}.rank{r}", weights_only=False) for r in range(2)]
    one = res[0]["one"]
    groups = list(dict.fromkeys(one.index.tolist()))
    assert groups == [10, 11, 12, 13, 20, 21]  # rank 0's in order, then rank 1's new ones, first KEEP
    assert one.index.tolist().count(13) == 2 * N and one.index.tolist().count(21) == 2 * N
    for r in range(2):  # each rank's rows: the 1-rank batch's rows of its groups, in the same order
        mine = set(minibatch_major_shard(groups, r, 2, MINI))
        _same(res[r]["got"], one.select([i for i, g in enumerate(one.index.tolist()) if g in mine]))
