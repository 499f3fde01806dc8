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

import re
from typing import Any, Literal

# verl clips to the tail: the answer is at the end and the regex is slow on long strings.
_SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")


def _normalize(number: str) -> str:
    return number.replace(",", "").replace("$", "")


def extract_solution(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer in ``solution_str``, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got '{method}'")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(solution_str)
        return _normalize(found[-1]) if found else None
    for candidate in reversed(_NUMBER_RE.findall(solution_str)):
        if candidate not in ("", "."):
            return _normalize(candidate)
    return None


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
