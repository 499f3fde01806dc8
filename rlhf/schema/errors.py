"""Errors that more than one layer raises and the entry points report as one ``error:`` line."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """Non-finite numbers where training cannot go on: too many consecutive optimizer steps with a
    non-finite loss or gradient norm (:class:`rlhf.train.optim.NonFiniteGuard`), or a policy whose
    logits are not finite in a rollout (:mod:`rlhf.rollout.engine`)."""
