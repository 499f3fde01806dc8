"""Designed waits and the weight transfer of trainer.mode one_step_off, on 2 gloo ranks.

* The rollout layout's row exchange (``RolloutLayout.dp_group``) waits for the slowest
  replica: it has its own timeout (``trainer.exchange_timeout_s``), so a replica that
  finishes generating long before the other does not hit the collective timeout.
* ``send_tensors`` / ``recv_tensors``: small tensors packed into one reusable buffer, large
  ones sent from their own memory; the sender's dict is consumed as it goes (no
  ``torch.cat`` of all weights next to them), the receiver gets the same tensors, each in
  its own memory.
"""

from __future__ import annotations

import datetime
import time

import torch

from tests.dist._dist_utils import run_distributed

COLLECTIVE_S = 2.0


def _check(rank: int, world: int) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from rlhf.rollout.reshard import RolloutLayout
    from rlhf.train.async_rl.transfer import message_groups, recv_tensors, send_tensors

    # As init_distributed does: every new group gets the collective timeout unless told otherwise.
    c10d.default_pg_timeout = datetime.timedelta(seconds=COLLECTIVE_S)
    layout = RolloutLayout.build(1, "cpu", exchange_timeout_s=60)
    if rank == 1:
        time.sleep(2 * COLLECTIVE_S)  # the slow replica, still generating
    rows = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(rows, torch.full((3,), float(rank)), group=layout.dp_group)
    assert [r[0].item() for r in rows] == [0.0, 1.0]

    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    sent = {"a": torch.randn(3, 5, generator=g), "empty": torch.zeros(0), "big": torch.randn(40, generator=g),
            "b": torch.randn(7, generator=g), "h": torch.randn(4, 4, generator=g).bfloat16(),
            "c": torch.randn(2, 2, generator=g)}
    bucket = 24 * 4  # 24 fp32 elements: a | b + c | big alone; bf16: h
    assert message_groups([t.numel() for n, t in sent.items() if t.dtype == torch.float32], 24) == [[0], [2], [3, 4]]
    if rank == 0:
        mine = dict(sent)
        n = send_tensors(mine, 1, torch.device("cpu"), pair, bucket_bytes=bucket)
        assert mine == {} and n == sum(t.numel() * t.element_size() for t in sent.values())
    else:
        got = recv_tensors(0, torch.device("cpu"), pair)
        assert set(got) == set(sent)
        for name, t in sent.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
            # its own memory: the consumer (the sampler fusing q|k|v) can free it alone
            assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size(), name


def test_replica_exchange_outlasts_the_collective_timeout_and_weights_cross_in_buckets():
    run_distributed(_check, 2, timeout_s=COLLECTIVE_S)


# ---------------------------------------------------------------- the rollout row exchange

R_EX, N_EX, PROMPTS_EX = 6, 2, 5
WANTS = {0: [4, 0, 3], 1: [1, 2]}  # prompts each rank trains on (chunks: [0, 3) on replica 0, [3, 5) on 1)


def _row(i: int, j: int):
    """Sample j of prompt i: ids, mask (a hole at t = 1: a multi-turn observation), log-probs, length."""
    length = 1 + (i + j) % R_EX
    t = torch.arange(R_EX)
    ids = torch.where(t < length, (i * 10 + j * 3 + t) % 50, 0)
    mask = (t < length) & (t != 1)
    logp = torch.where(t < length, -(i + j + t).float() / 7, 0.0)
    return ids, mask, logp, length


ROUTES_EX = (4 + R_EX, 2, 2)  # MoE routes per row: [P + R, sparse layers, top-k] int16


def _rows(prompts):
    from rlhf.rollout.sampler import RolloutOutput

    rows = [_row(i, j) for i in prompts for j in range(N_EX)]
    routes = torch.stack([torch.arange(40, dtype=torch.int16).view(ROUTES_EX) + 100 * i + 10 * j
                          for i in prompts for j in range(N_EX)])
    return RolloutOutput(response_ids=torch.stack([r[0] for r in rows]), response_mask=torch.stack([r[1] for r in rows]),
                         log_probs=torch.stack([r[2] for r in rows]),
                         response_lengths=torch.tensor([r[3] for r in rows]),
                         truncated=torch.tensor([r[3] == R_EX for r in rows]),
                         prompt_index=torch.arange(len(prompts)).repeat_interleave(N_EX), routes=routes)


def _exchange(rank: int, world: int) -> None:
    import torch.distributed as dist

    from rlhf.rollout.engine import chunk_bounds
    from rlhf.rollout.exchange import exchange_rows
    from tests.dist._dist_utils import dist_device

    bounds = chunk_bounds(PROMPTS_EX, world)
    s, e = bounds[rank]
    moved = []
    real = dist.all_to_all_single

    def counting(out, inp, *a, **k):
        moved.append(out.numel() * out.element_size())
        return real(out, inp, *a, **k)

    dist.all_to_all_single = counting
    dev = dist_device()  # the CPU over gloo; this rank's GPU under the nccl switch (tests/gpu/test_dist_nccl.py)
    mine = _rows(range(s, e))
    for k in ("response_ids", "response_mask", "log_probs", "response_lengths", "truncated"):
        setattr(mine, k, getattr(mine, k).to(dev))
    got = exchange_rows(mine, bounds, N_EX, WANTS[rank], R_EX, world, None, dev)
    ref = _rows(WANTS[rank])
    for k in ("response_ids", "response_mask", "log_probs", "response_lengths", "truncated", "prompt_index"):
        assert torch.equal(getattr(got, k).cpu(), getattr(ref, k)), k
    # only this rank's rows arrive, packed in int32: (2R + 2) x 4 bytes each
    assert moved == [len(WANTS[rank]) * N_EX * (2 * R_EX + 2) * 4], moved
    assert got.routes is None  # not asked for
    # a MoE sampler's routes (R3) follow their rows in a second all-to-all, int16
    mine.routes = mine.routes.to(dev)
    got = exchange_rows(mine, bounds, N_EX, WANTS[rank], R_EX, world, None, dev, ROUTES_EX)
    assert torch.equal(got.routes.cpu(), ref.routes) and torch.equal(got.response_ids.cpu(), ref.response_ids)
    assert moved[-1] == len(WANTS[rank]) * N_EX * 40 * 2, moved


def test_rollout_rows_reach_only_the_ranks_that_train_on_them_packed_narrow():
    run_distributed(_exchange, 2)
