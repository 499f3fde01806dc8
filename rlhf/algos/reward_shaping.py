"""Reward shaping applied to sequence scores before advantage estimation."""

from __future__ import annotations

import torch

from rlhf.algos.masked import mask_end

__all__ = ["overlong_reward_penalty", "place_reward_on_last_token"]


def overlong_reward_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), as verl's DAPO reward manager.

    With ``L_max = max_response_length`` and ``L_cache = overlong_buffer_len``::

        R(y) = 0                                           if |y| <= L_max - L_cache
        R(y) = -(|y| - (L_max - L_cache)) / L_cache * f     otherwise

    i.e. linear from 0 down to ``-f`` at ``|y| = L_max`` (``f = penalty_factor``; DAPO uses 1).
    Shape: ``response_lengths [B]`` -> penalty ``[B]`` (float), to be *added* to the task score.

    ``|y|`` is the trajectory length: every response-side token in context, generated and
    tool output alike (``RolloutBatch.trajectory_lengths``), as verl's DAPO reward manager
    counts ``attention_mask[prompt_length:]``.  ``L_max`` bounds the whole trajectory, and the
    penalty exists to steer the policy away from being cut off there, so tool outputs count
    even though they carry no loss.  On single-turn rollouts this is the generated length.
    """
    if overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len must be > 0, got {overlong_buffer_len}")
    if overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len ({overlong_buffer_len}) exceeds max_response_length ({max_response_length})"
        )
    expected_len = max_response_length - overlong_buffer_len
    exceed = response_lengths.float() - expected_len
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)


def place_reward_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence score on its last generated token (outcome reward).

    Shapes: ``scores [B]``, ``response_mask [B, T]`` -> ``token_level_scores [B, T]`` (zeros
    elsewhere).  The position is the last one where ``response_mask`` is 1, not
    ``mask.sum() - 1``: with masked tool outputs (holes) the count is smaller than the
    position, and a trajectory that ends on a tool output must not put its reward there
    (a masked position takes no part in any estimator).  As verl's
    ``select_response_ids_for_reward``.  A row with an empty mask gets no reward.
    """
    B, T = response_mask.shape
    end = mask_end(response_mask)  # [B]
    last = (end - 1).clamp(min=0)
    has_token = end > 0
    out = torch.zeros(B, T, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                      device=response_mask.device)
    rows = torch.arange(B, device=response_mask.device)
    out[rows, last] = torch.where(has_token, scores.to(out.dtype), torch.zeros_like(scores, dtype=out.dtype))
    return out
