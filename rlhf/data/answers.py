"""Final-answer extraction shared by the rule-based rewards and dataset preparation.

The rewards (:mod:`rlhf.rewards.gsm8k`, :mod:`rlhf.rewards.math_answer`) read a response's answer
with these functions; :mod:`rlhf.data.prepare` reads a dataset's ground truth with the same ones,
so a prepared ground truth is what the reward will compare against. Pure string functions.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

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


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text`` with balanced braces, or None.

    ``\\boxed 5`` (no braces) is accepted up to the next space or ``$``.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    head = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    rest = text[start + len(head):]
    if rest.startswith(" "):
        body = rest[1:].split("$")[0].split(" ")[0]
        return f"{head}{{{body}}}" if body else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return head + rest[: i + 1]
    return None  # unbalanced: the response was cut inside the box


def remove_boxed(boxed: str) -> str:
    """``\\boxed{x}`` -> ``x`` (the inverse of the wrapping done by :func:`last_boxed_only_string`)."""
    for head in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(head) and boxed.endswith("}"):
            return boxed[len(head):-1]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def extract_boxed_answer(text: str) -> Optional[str]:
    """Content of the last box in ``text``, or None when there is no complete box."""
    boxed = last_boxed_only_string(text)
    return remove_boxed(boxed).strip() if boxed is not None else None
