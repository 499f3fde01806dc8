"""Deterministic, resumable order of prompt batches, and the data-parallel split.

Every rank builds the same :class:`PromptLoader` (same ``seed``), so every rank computes
the same *global* batch of dataset indices without any communication, then keeps its own
contiguous slice with :func:`shard`. The order is a function of ``(seed, epoch)`` only —
epoch ``e`` is ``torch.randperm(N, generator=manual_seed(seed + e))`` — so a run resumed
from ``state_dict()`` ``{"epoch", "position"}`` sees exactly the batches that the
uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch


def shard(indices: Sequence[int], dp_rank: int, dp_size: int) -> list[int]:
    """This rank's contiguous slice of a global batch.

    Args:
        indices: ``[B]`` global batch (same on all ranks).
        dp_rank: rank in the data-parallel group, ``0 <= dp_rank < dp_size``.
        dp_size: data-parallel world size; must divide ``B``.

    Returns:
        ``indices[dp_rank * B/dp_size : (dp_rank + 1) * B/dp_size]``.
    """
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
    n = len(indices)
    if n % dp_size != 0:
        raise ValueError(
            f"batch of {n} prompts does not split evenly over dp_size={dp_size} ranks; "
            f"choose a train_batch_size divisible by {dp_size} (or drop_last=True)"
        )
    per_rank = n // dp_size
    return list(indices[dp_rank * per_rank : (dp_rank + 1) * per_rank])


class PromptLoader:
    """Epoch-wise shuffled batches of dataset indices, resumable mid-epoch.

    Iterating (``for batch in loader``) yields the remaining batches of the current epoch;
    iterating again moves to the next epoch. :meth:`next_batch` rolls over epochs on its own.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if dataset_len <= 0:
            raise ValueError(f"dataset is empty (dataset_len={dataset_len})")
        if drop_last and dataset_len < batch_size:
            raise ValueError(
                f"dataset has {dataset_len} prompts, fewer than one batch of {batch_size}; "
                f"lower the batch size or set drop_last=False"
            )
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches already taken from the current epoch
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.dataset_len // self.batch_size
        return -(-self.dataset_len // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """The index order of ``epoch`` (a permutation of ``range(dataset_len)``)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def _batch_at(self, epoch: int, position: int) -> list[int]:
        if self._order_epoch != epoch:
            self._order = self.epoch_order(epoch)
            self._order_epoch = epoch
        start = position * self.batch_size
        return self._order[start : start + self.batch_size]

    def next_batch(self) -> list[int]:
        """The next global batch ``[batch_size]`` of indices, moving to the next epoch when due."""
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        batch = self._batch_at(self.epoch, self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        epoch = self.epoch
        while self.epoch == epoch and self.position < self.steps_per_epoch:
            yield self.next_batch()

    def shard(self, indices: Sequence[int], dp_rank: int, dp_size: int) -> list[int]:
        """See :func:`shard`."""
        return shard(indices, dp_rank, dp_size)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "dataset_len", "batch_size"}``; the last three are checked on load."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state from a different seed, dataset or batch size."""
        for key in ("seed", "dataset_len", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data loader state has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    f"resuming would change the data order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
