"""The scalar value head of a critic or reward model (``AutoModelFor{Token,Sequence}Classification``).

Shared by the PPO critic (:mod:`rlhf.train.critic`) and the reward model (:mod:`rlhf.rewards.reward_model`),
so it lives in the lower of their layers.
"""

from __future__ import annotations

import torch

from rlhf.schema.config import ConfigError

_HEAD_NAMES = ("score", "classifier")


def value_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The ``Linear(hidden, 1)`` head of a token/sequence-classification model."""
    for name in _HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ConfigError(f"{type(model).__name__} has no linear value head (looked for {', '.join(_HEAD_NAMES)})")
