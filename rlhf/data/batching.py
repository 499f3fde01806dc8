"""Dynamic batch size: token-budget micro-batches, balanced across dp ranks.

verl's ``use_dynamic_bsz``: instead of a fixed number of sequences per micro-batch, a
rank packs sequences into micro-batches of at most ``ppo_max_token_len_per_gpu`` real
tokens (separate budgets are used for forward-only passes and for the critic; the
caller passes the one that applies). Both partitions below use the Karmarkar-Karp
largest-differencing method (Karmarkar & Karp 1982, "the differencing method of set
partitioning"), generalised to k sets as in verl's ``seqlen_balancing``: every item
starts as a k-tuple of sets; repeatedly take the two tuples with the largest spread
(max sum - min sum) and merge them by pairing the heaviest set of one with the lightest
set of the other.

Equal micro-batch counts on every rank. FSDP2 issues collectives (all-gather /
reduce-scatter) per forward and backward, so every dp rank must run the same number
of micro-batches. The protocol is: each rank computes its own minimum count,
:func:`sync_num_micro_batches` takes the MAX over the group, and every rank re-partitions
with ``min_num_micro_batches=max`` - a rank that needed fewer simply splits its
sequences into more, smaller micro-batches (still within the budget). Only when a rank
holds fewer sequences than the count does it get empty micro-batches; the trainer must
then run a forward/backward on a dummy one-token input with loss multiplied by 0 so the
collectives still match. After :func:`balance_across_dp` every rank has the same number
of sequences, so this does not happen unless the count exceeds that number.

Loss normalisation stays exact because the aggregation divides each micro-batch's sum
by the *global* token (or sequence) count, never by the micro-batch's own count; then
the sum over micro-batches equals the full-batch loss for any partition.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "karmarkar_karp",
    "make_token_budget_micro_batches",
    "balance_across_dp",
    "sync_num_micro_batches",
    "micro_batches_for_rank",
    "reverse_index",
    "seq_lens_from_mask",
]


def _as_list(seq_lens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(seq_lens, torch.Tensor):
        return [int(x) for x in seq_lens.flatten().tolist()]
    return [int(x) for x in seq_lens]


def seq_lens_from_mask(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per sequence (``attention_mask [B, L]`` -> ``B`` ints)."""
    return _as_list(attention_mask.sum(dim=-1))


class _State:
    """k sets, kept sorted by sum descending."""

    __slots__ = ("sets", "sums")

    def __init__(self, sets: list[list[int]], sums: list[int]) -> None:
        order = sorted(range(len(sums)), key=lambda i: (-sums[i], i))
        self.sets = [sets[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: "_State") -> "_State":
        k = len(self.sums)
        return _State(
            [self.sets[i] + other.sets[k - 1 - i] for i in range(k)],
            [self.sums[i] + other.sums[k - 1 - i] for i in range(k)],
        )


def karmarkar_karp(seq_lens: Sequence[int] | torch.Tensor, k: int, equal_size: bool) -> list[list[int]]:
    """Partition indices ``0..n-1`` into ``k`` sets with near-equal sums of ``seq_lens``.

    Args:
        seq_lens: ``n`` non-negative weights.
        k: number of sets.
        equal_size: every set gets ``n / k`` items (``n % k == 0`` required).

    Returns:
        ``k`` lists of indices, each sorted ascending; sets ordered by sum descending.
    """
    lens = _as_list(seq_lens)
    n = len(lens)
    if k < 1:
        raise ValueError(f"number of partitions must be >= 1, got {k}")
    if equal_size and n % k != 0:
        raise ValueError(f"equal-size partition needs len(seq_lens) divisible by k; got {n} items for k={k}")
    items = sorted(range(n), key=lambda i: (lens[i], i))
    heap: list[tuple[int, int, _State]] = []
    tick = 0
    if equal_size:
        for off in range(0, n, k):
            chunk = items[off : off + k]
            st = _State([[i] for i in chunk], [lens[i] for i in chunk])
            heap.append((-st.spread, tick, st))
            tick += 1
    else:
        for i in items:
            st = _State([[i]] + [[] for _ in range(k - 1)], [lens[i]] + [0] * (k - 1))
            heap.append((-st.spread, tick, st))
            tick += 1
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        m = a.merge(b)
        heapq.heappush(heap, (-m.spread, tick, m))
        tick += 1
    return [sorted(s) for s in heap[0][2].sets]


def _split_to_count(bins: list[list[int]], lens: list[int], count: int) -> list[list[int]]:
    """Split the heaviest multi-item bins in two (balanced) until there are ``count`` bins;
    pad with empty bins only if every bin already holds one sequence."""
    bins = [b for b in bins if b]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            break
        heavy = max(splittable, key=lambda b: sum(lens[i] for i in b))
        bins.remove(heavy)
        halves = karmarkar_karp([lens[i] for i in heavy], 2, equal_size=False)
        bins.extend([[heavy[j] for j in h] for h in halves])
    return bins


def make_token_budget_micro_batches(
    seq_lens: Sequence[int] | torch.Tensor, max_token_len: int, min_num_micro_batches: int = 1
) -> list[list[int]]:
    """Group sequences into micro-batches of at most ``max_token_len`` tokens.

    Starts from ``k = ceil(total / max_token_len)`` bins (the lower bound) and increases
    ``k`` until the Karmarkar-Karp partition fits the budget. A sequence longer than the
    budget alone gets its own micro-batch.

    Args:
        seq_lens: real tokens per sequence (``B`` ints).
        max_token_len: token budget per micro-batch (verl's ``ppo_max_token_len_per_gpu``).
        min_num_micro_batches: produce at least this many (the dp-wide max, see module doc).

    Returns:
        Micro-batches as lists of indices; every index appears exactly once.
    """
    lens = _as_list(seq_lens)
    if max_token_len < 1:
        raise ValueError(f"max_token_len must be >= 1, got {max_token_len}")
    oversized = [[i] for i, n in enumerate(lens) if n > max_token_len]
    rest = [i for i, n in enumerate(lens) if n <= max_token_len]
    bins: list[list[int]] = []
    if rest:
        rest_lens = [lens[i] for i in rest]
        k = max(math.ceil(sum(rest_lens) / max_token_len), 1, min_num_micro_batches - len(oversized))
        k = min(k, len(rest))
        while True:
            parts = karmarkar_karp(rest_lens, k, equal_size=False)
            if max(sum(rest_lens[j] for j in p) for p in parts) <= max_token_len or k >= len(rest):
                break
            k += 1
        bins = [[rest[j] for j in p] for p in parts if p]
    bins = oversized + bins
    if len(bins) < min_num_micro_batches:
        bins = _split_to_count(bins, lens, min_num_micro_batches)
    return bins


def balance_across_dp(seq_lens: Sequence[int] | torch.Tensor, dp_size: int) -> list[list[int]]:
    """Split a global batch into ``dp_size`` groups of equal count and balanced tokens.

    verl's ``get_seqlen_balanced_partitions(seq_lens, dp_size, equal_size=True)``: rank
    ``r`` takes ``groups[r]``, so no rank waits on a longer one.

    Args:
        seq_lens: real tokens per sequence of the *global* batch (``n``, divisible by dp).
        dp_size: number of data-parallel ranks.

    Returns:
        ``dp_size`` sorted index lists of ``n / dp_size`` items.
    """
    lens = _as_list(seq_lens)
    if len(lens) % dp_size != 0:
        raise ValueError(f"global batch of {len(lens)} sequences does not split evenly over dp_size={dp_size}")
    groups = karmarkar_karp(lens, dp_size, equal_size=True)
    return sorted(groups, key=lambda g: g[0] if g else -1)


def sync_num_micro_batches(
    n_local: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> int:
    """MAX of ``n_local`` over the process group (identity without torch.distributed).

    Args:
        n_local: micro-batches this rank needs.
        group: the dp process group (default: the world).
        device: where the 1-element tensor lives; must suit the backend (cuda for nccl).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return int(n_local)
    if device is None:
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl" and torch.accelerator.is_available():
            device = torch.accelerator.current_accelerator()
    t = torch.tensor([int(n_local)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def micro_batches_for_rank(
    seq_lens: Sequence[int] | torch.Tensor,
    max_token_len: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> list[list[int]]:
    """Token-budget micro-batches with the same count on every rank of ``group``."""
    local = make_token_budget_micro_batches(seq_lens, max_token_len)
    n = sync_num_micro_batches(len(local), group, device)
    if n == len(local):
        return local
    return make_token_budget_micro_batches(seq_lens, max_token_len, min_num_micro_batches=n)


def reverse_index(micro_batches: list[list[int]]) -> list[int]:
    """``rev`` such that ``torch.cat(outputs_in_micro_batch_order)[rev]`` is in the
    original order (verl's ``get_reverse_idx``)."""
    flat = [i for mb in micro_batches for i in mb]
    rev = [0] * len(flat)
    for pos, i in enumerate(flat):
        rev[i] = pos
    return rev
