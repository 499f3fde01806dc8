"""Critic loss for PPO and the explained-variance diagnostic (verl's numbers)."""

from __future__ import annotations

import torch

from rlhf.algos.aggregation import AggNorm, agg_loss
from rlhf.algos.masked import masked_mean

__all__ = ["compute_value_loss", "explained_variance"]


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    norm: AggNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 baselines / verl's ``compute_value_loss``).

    ``V_clip = clamp(V_new, V_old - c, V_old + c)``,
    ``L_t = 0.5 * max((V_new - R)^2, (V_clip - R)^2)`` aggregated with ``agg_loss``.

    Note the argument order ``(vpreds, values, returns)``: verl's is ``(vpreds, returns, values)``.
    Pass them by keyword when in doubt.

    Shapes: all ``[B, T]``.  Returns ``(vf_loss scalar, vf_clipfrac scalar detached)``, where
    ``vf_clipfrac`` is the masked share of tokens where the clipped term is larger.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, norm)
    with torch.no_grad():
        vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[R - V] / (Var[R] + 1e-5)`` over masked tokens (unbiased variances, as verl).

    1 means the critic predicts the returns perfectly, 0 means no better than a constant.
    Shapes: ``[B, T]`` -> scalar.
    """
    sel = mask.bool()
    valid_returns = returns[sel]
    valid_values = values[sel]
    if valid_returns.numel() < 2:
        return torch.full((), float("nan"), device=returns.device)
    return 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
