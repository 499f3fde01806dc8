"""DAPO's answer format: the response's last ``Answer: <x>`` line, +1 if right and -1 if not.

The DAPO-Math-17k prompts end with "Remember to put your answer on its own line after
\\"Answer:\\"", and DAPO (and verl's ``math_dapo`` scorer) reward +1 / -1. The check
is the Minerva one: both sides go through the same string normalisation (text after
the last ``=``, units and filler words dropped, ``\\text{}`` / ``\\boxed{}`` unwrapped,
``\\frac12`` -> ``\\frac{1}{2}``, thousands separators removed) and must then be equal.
That is exact for DAPO's integer answers and needs no optional dependency; use the
``math`` reward for semantic equivalence of general LaTeX answers.
"""

from __future__ import annotations

import re
from typing import Any, Optional

# Only the tail is searched: the answer line is last, and the regexes stay cheap on long responses.
TAIL_CHARS = 300
ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
# Units, filler words and LaTeX spacing that do not change the answer.
_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
         "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
         "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
         "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
         ",\\!", "{,}", '"', "\\dots")
_UNWRAP = [re.compile(r"\\" + cmd + r"\{(.*?)\}") for cmd in ("text", "textbf", "overline")]
_BOXED = re.compile(r"\\boxed\{(.*)\}")
_DOLLARS = re.compile(r"^.*?\$(.*?)\$.*$", re.S)
_SHORT_FRAC = re.compile(r"frac([^{])(.)")
_SHORT_SQRT = re.compile(r"sqrt([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer string (see the module docstring)."""
    s = answer.split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for junk in _DROP:
        s = s.replace(junk, "")
    s = _DOLLARS.sub(r"$\1$", s) if s.count("$") >= 2 else s
    for pat in _UNWRAP:
        s = pat.sub(r"\1", s)
    s = _BOXED.sub(r"\1", s)
    s = _SHORT_FRAC.sub(r"frac{\1}{\2}", s)
    s = _SHORT_SQRT.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer_line(solution_str: str) -> Optional[str]:
    """Text after the last ``Answer:`` (case-insensitive) in the tail of the response, or None."""
    found = ANSWER_RE.findall(solution_str[-TAIL_CHARS:])
    return found[-1] if found else None


def math_dapo(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """DAPO reward: ``{"score": +1.0 | -1.0, "acc": 1.0 | 0.0, "pred": normalised answer}``.

    A response without an ``Answer:`` line scores -1 with ``pred = "[INVALID]"``.
    """
    raw = extract_answer_line(solution_str)
    pred = normalize_final_answer(raw) if raw is not None else INVALID
    ok = raw is not None and pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if ok else -1.0, "acc": 1.0 if ok else 0.0, "pred": pred}
