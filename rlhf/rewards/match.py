"""Exact string match reward."""

from __future__ import annotations

from typing import Any


def exact_match(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
) -> float:
    """1.0 if the response equals the ground truth after stripping surrounding whitespace, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
