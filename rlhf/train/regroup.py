"""Dynamic sampling's regrouping: the kept prompt groups, dealt to dp ranks, moved as tensors.

Under ``algorithm.filter_groups`` each dp rank keeps the informative groups of every
generation batch it made, so ranks hold different numbers of groups. The step trains on
the first ``train_batch_size`` groups in rank order (rank 0's groups in the order it kept
them, then rank 1's, ...), dealt mini-batch-major to the dp ranks like fresh prompts.

Only group ids and row counts cross as metadata (two small all-gathers); the rows
themselves move with one ``all_to_all_single`` per tensor field, each row straight from
the rank that holds it to the rank that trains on it (before: every rank pickled its whole
batch and received every other rank's). Per-row Python lists (texts, ground truths) do not
travel; the caller rebuilds them (:meth:`rlhf.train.trainer.RLTrainer.rebalance_groups`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from rlhf.schema.batch import RolloutBatch, minibatch_major_shard


def _gather_groups(gids: list[int], counts: list[int], group, device: torch.device) -> list[list[tuple[int, int]]]:
    """Every rank's ``(group id, rows)`` pairs, in rank order (two all-gathers of small tensors)."""
    dp = dist.get_world_size(group)
    n = torch.tensor([len(gids)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dp)]
    dist.all_gather(sizes, n, group=group)
    sizes_l = torch.cat(sizes).tolist()
    mine = torch.zeros(2, max(1, *sizes_l), dtype=torch.long)
    mine[0, :len(gids)] = torch.tensor(gids, dtype=torch.long)
    mine[1, :len(gids)] = torch.tensor(counts, dtype=torch.long)
    mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in range(dp)]
    dist.all_gather(every, mine, group=group)
    return [list(zip(*(row[:size] for row in t.tolist()))) for size, t in zip(sizes_l, every)]


def regroup_rows(batch: RolloutBatch, *, keep_groups: int, dp_rank: int, dp: int, mini_batch_size: int,
                 group: Optional[dist.ProcessGroup] = None) -> RolloutBatch:
    """This rank's rows of the first ``keep_groups`` groups over all dp ranks (see module docstring).

    Args:
        batch: this rank's kept rows; ``batch.index`` [N] holds each row's group (prompt) id.
        keep_groups: groups the step trains on (``data.train_batch_size``).
        dp_rank, dp, group: this rank in the dp group (``dp == 1``: no collective).
        mini_batch_size: ``actor.ppo_mini_batch_size`` (groups per mini-batch).

    Returns:
        The rows of this rank's groups, ordered by the groups' global order, then by their
        position in the rank-ordered concatenation of all ranks' batches. Tensor fields
        only; per-row list fields are empty.
    """
    index = batch.index.tolist()
    local: dict[int, int] = {}
    for g in index:
        local[g] = local.get(g, 0) + 1
    device = batch.index.device
    per_rank = _gather_groups(list(local), list(local.values()), group, device) if dp > 1 else [list(local.items())]
    groups = list(dict.fromkeys(g for pairs in per_rank for g, _ in pairs))[:keep_groups]
    order = {g: k for k, g in enumerate(groups)}
    dest = {g: r for r in range(dp) for g in minibatch_major_shard(groups, r, dp, mini_batch_size)}
    # Rows leave grouped by destination, each destination's in (group order, position) order.
    rows = sorted((i for i, g in enumerate(index) if g in dest), key=lambda i: (dest[index[i]], order[index[i]], i))
    send = [0] * dp
    for i in rows:
        send[dest[index[i]]] += 1
    recv = [sum(c for g, c in pairs if dest.get(g) == dp_rank) for pairs in per_rank]
    rows_t = torch.tensor(rows, dtype=torch.long)
    fields = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            fields[f.name] = _all_to_all_rows(v[rows_t.to(v.device)], send, recv, group) if dp > 1 \
                else v[rows_t.to(v.device)]
        elif isinstance(v, list):
            fields[f.name] = []
        else:
            fields[f.name] = v
    out = RolloutBatch(**fields)
    # Received source-rank-major: a stable sort by group order gives (group order, global position).
    got = out.index.tolist()
    return out.select(sorted(range(len(got)), key=lambda i: order[got[i]]))


def _all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows [sum(send), ...] out, rows [sum(recv), ...] in, split by rank along dim 0."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out
