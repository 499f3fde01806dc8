"""The prompt order under over-sampling: prompts taken one by one, aborted ones given back.

``rollout.over_sample_rate`` starts more prompts than a step trains on and aborts the slowest
groups (``rlhf.train.over_sampling``). The aborted prompts must not be lost: they go back to
the *front* of the order and are the first prompts of the next draw, so every prompt the
loader hands out is trained exactly once (or is still waiting here). The order behind the
backlog is the :class:`~rlhf.data.loader.PromptLoader`'s, unchanged: with nothing aborted the
prompts come in the same order as without over-sampling.

Like the loader, every rank holds the same :class:`PromptBacklog` and changes it only with
the same global arguments, so all ranks agree without communication; its state (the loader's
plus the waiting prompts) is saved with checkpoints, so a resumed run draws the same prompts.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from rlhf.data.loader import PromptLoader

__all__ = ["PromptBacklog", "started_prompts"]


def started_prompts(needed: int, rate: float, multiple: int = 1) -> int:
    """Prompts to start so that ``(1 - rate)`` of them is at least ``needed`` (verl's rule: the rest
    is aborted once ``(1 - rate) * started`` have finished), rounded up to a multiple of ``multiple``.

    >>> started_prompts(256, 0.1)
    285
    >>> started_prompts(8, 0.0)
    8
    """
    if not 0 <= rate < 1:
        raise ValueError(f"over_sample_rate must be in [0, 1), got {rate}")
    t = needed if rate == 0 else math.ceil(needed / (1 - rate) - 1e-9)
    while int(t * (1 - rate) + 1e-9) < needed:  # the float division may land one short
        t += 1
    return -(-t // multiple) * multiple


class PromptBacklog:
    """A :class:`PromptLoader`'s order, taken ``k`` prompts at a time, with given-back prompts first."""

    def __init__(self, loader: PromptLoader) -> None:
        self.loader = loader
        self.waiting: list[int] = []  # given back, then the unused rest of the last loader batch

    def take(self, k: int) -> list[int]:
        """The next ``k`` dataset indices: the waiting ones first, then the loader's batches in order."""
        while len(self.waiting) < k:
            self.waiting.extend(self.loader.next_batch())
        out, self.waiting = self.waiting[:k], self.waiting[k:]
        return out

    @property
    def epoch(self) -> int:
        """The loader's epoch (of the last batch it handed out)."""
        return self.loader.epoch

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    def next_batch(self) -> list[int]:
        """``take(batch_size)``: the loader's interface, for code that draws whole batches."""
        return self.take(self.loader.batch_size)

    def give_back(self, indices: Sequence[int]) -> None:
        """Put ``indices`` (taken, not trained) in front of the order, in the order given."""
        self.waiting[:0] = [int(i) for i in indices]

    def state_dict(self) -> dict[str, Any]:
        """The loader's state plus ``"waiting"`` (checked by the loader's own keys on load)."""
        return {**self.loader.state_dict(), "waiting": list(self.waiting)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a loader state without ``"waiting"`` (saved without over-sampling) waits for none."""
        self.loader.load_state_dict(state)
        self.waiting = [int(i) for i in state.get("waiting", [])]
