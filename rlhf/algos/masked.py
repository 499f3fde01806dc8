"""Masked reductions over padded ``[B, T]`` tensors.

Semantics follow verl's ``verl/utils/torch_functional.py`` so that statistics (and hence
whitened advantages) are numerically the same as verl's.  ``mask`` may be bool or float;
a float mask acts as per-element weights.  Values at masked positions never reach the
result, even when they are ``nan``/``inf`` (padding after a sampler stop can hold any value).
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "mask_end"]


def _zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # torch.where (not values * mask) so that nan/inf in padding cannot poison the sum.
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)) * mask


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all elements when ``None``).

    Shapes: ``values``, ``mask`` broadcastable, e.g. ``[B, T]``; result ``[]`` or reduced.
    """
    valid = _zero_masked(values, mask)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / (sum(mask) + 1e-8)`` — verl's masked_mean (0 for an empty mask).

    Shapes: ``values``, ``mask`` ``[B, T]``; result ``[]`` (``dim=None``) or reduced over ``dim``.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked-in elements (scalar).

    ``var = mean_m((x - mean_m(x))^2)``, times the Bessel factor ``n / (n - 1)`` when
    ``unbiased`` (``n = sum(mask)``), as verl.  Raises ``ValueError`` for ``n < 2`` when
    ``unbiased`` because the Bessel factor is undefined.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element; at least two are needed.")
        if n == 1:
            raise ValueError(
                "masked_var: the mask selects one element, so the unbiased variance divides by zero; "
                "use a batch with more than one response token."
            )
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise with masked statistics: ``(x - mean) / sqrt(var + 1e-8)``.

    With ``shift_mean=False`` the mean is added back (only the scale changes).  Statistics are
    over every masked-in element of the tensor passed (the whole local batch), with unbiased
    variance as verl.  Shape: ``[B, T]`` -> ``[B, T]`` (masked-out positions are not zeroed).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def mask_end(mask: torch.Tensor) -> torch.Tensor:
    """One past the last masked-in position of each row, 0 for an empty row: ``[B, T]`` -> ``[B]`` long.

    Equals ``mask.sum(-1)`` only when the mask is a prefix of ones; a response with masked
    tool outputs (holes) ends later than its token count.
    """
    valid = mask.bool()
    T = valid.shape[-1]
    end = T - valid.flip(dims=[-1]).to(torch.int8).argmax(dim=-1)  # argmax: first max, i.e. the last 1
    return torch.where(valid.any(dim=-1), end, torch.zeros_like(end))
