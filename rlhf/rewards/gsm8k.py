"""GSM8K-style answer checking: the final number after ``####``.

Same extraction and scores as verl's ``verl/utils/reward_score/gsm8k.py``:

* ``strict``: the last ``#### <number>`` in the (last 300 characters of the) response;
  ``,`` and ``$`` removed; no ``####`` -> 0.0, wrong number -> ``format_score``,
  right number -> ``score``.
* ``flexible``: the last number anywhere in the response (``""``/``"."`` skipped). Unlike
  verl, thousands separators are removed here too, so ``1,000`` matches ``1000``.

The comparison is string equality after normalisation, as in verl (``"85.0" != "85"``).
"""

from __future__ import annotations

from typing import Any, Literal

from rlhf.data.answers import _normalize, extract_solution


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score`` if an
    answer was found but is wrong, 0.0 if none was found (verl's ``gsm8k.compute_score``)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == _normalize(str(ground_truth).strip()) else float(format_score)


def gsm8k(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Strict GSM8K reward (``#### <number>`` required)."""
    return compute_score(solution_str, ground_truth, "strict", format_score, score)


def gsm8k_flexible(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Flexible GSM8K reward (the last number in the response)."""
    return compute_score(solution_str, ground_truth, "flexible", format_score, score)
