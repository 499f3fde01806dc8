"""Rollout: the built-in KV-cache sampler (and, later, resharding to the rollout layout)."""

from rlhf.models.arch import SUPPORTED_MODEL_TYPES
from rlhf.rollout.sampler import RolloutOutput, Sampler
from rlhf.rollout.sampling import SamplingParams

__all__ = ["SUPPORTED_MODEL_TYPES", "RolloutOutput", "Sampler", "SamplingParams"]
