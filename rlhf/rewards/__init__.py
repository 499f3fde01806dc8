"""Rule-based reward functions (verl signature), a registry, and batch scoring."""

from rlhf.rewards.gsm8k import compute_score as gsm8k_compute_score
from rlhf.rewards.gsm8k import extract_solution, gsm8k, gsm8k_flexible
from rlhf.rewards.match import exact_match
from rlhf.rewards.registry import (
    DATA_SOURCE_REWARDS,
    RewardFn,
    default_compute_score,
    get_reward_fn,
    list_reward_fns,
    register_reward_fn,
)
from rlhf.rewards.scoring import ScoreResult, score_responses

__all__ = [
    "DATA_SOURCE_REWARDS",
    "RewardFn",
    "ScoreResult",
    "default_compute_score",
    "exact_match",
    "extract_solution",
    "get_reward_fn",
    "gsm8k",
    "gsm8k_compute_score",
    "gsm8k_flexible",
    "list_reward_fns",
    "register_reward_fn",
    "score_responses",
]
