"""MATH-style answer checking: the last ``\\boxed{...}`` of a response, judged by math-verify.

verl's ``math`` scorer compares boxed strings after a hand-written normalisation; here
the comparison is semantic: `math-verify <https://github.com/huggingface/Math-Verify>`_
parses both sides into sympy objects and tests equivalence, so ``\\frac{1}{2}``, ``1/2``,
``0.5`` and ``\\dfrac12`` match, ``\\sqrt{8}`` matches ``2\\sqrt{2}``, ``50\\%`` matches
``0.5`` and ``50``, intervals keep their open/closed ends, units and degree signs are
stripped, and sets compare as sets.

math-verify is an optional dependency (``pip install -e ".[math]"``). Parsing and
verification run under math-verify's own timeouts (``timeout_s``), which use SIGALRM
and therefore only exist in a process's main thread; in another thread they are off
and the caller's timeout (e.g. a reward worker pool) must bound the call.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

# Re-exported: the extraction is shared with dataset preparation (rlhf.data.prepare), one layer down.
from rlhf.data.answers import extract_boxed_answer, last_boxed_only_string, remove_boxed  # noqa: F401

MATH_VERIFY_HINT = 'math-verify is not installed; run: pip install -e ".[math]"  (or: pip install math-verify)'
DEFAULT_TIMEOUT_S = 5


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(MATH_VERIFY_HINT) from None
    return parse, verify


def _timeout(timeout_s: Optional[float]) -> Optional[int]:
    # math-verify's timeouts install a SIGALRM handler, which Python allows only in the main thread.
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return None
    return max(1, int(round(timeout_s)))


def answers_equivalent(pred: str, gold: str, *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> bool:
    """True when the LaTeX answers ``pred`` and ``gold`` are mathematically equivalent.

    Both are parsed as the content of a ``\\boxed{}``; an unparsable or timed-out side is
    never equivalent.
    """
    parse, verify = _math_verify()
    t = _timeout(timeout_s)
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=t)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=t)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=t))


def gold_answers(ground_truth: Any) -> list[str]:
    """Accepted answers: a list (or its JSON encoding, as the dataset loader stores lists), or one string.
    A gold that is itself a worked solution with a box keeps only the boxed answer."""
    gt = ground_truth
    if isinstance(gt, str) and gt.startswith("["):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError:
            pass
    items = gt if isinstance(gt, (list, tuple)) else [gt]
    out = []
    for g in items:
        g = str(g)
        boxed = extract_boxed_answer(g)
        out.append(boxed if boxed else g.strip())
    return out


def math_verify_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Optional[dict[str, Any]] = None,
    *,
    timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """1.0 if the last ``\\boxed{}`` of ``solution_str`` is equivalent to the ground truth, else 0.0.

    Returns ``{"score", "acc", "pred"}``; ``pred`` (the boxed content, None without a
    complete box) is what majority voting (maj@k) counts.
    """
    _math_verify()  # fail with the pip command even when the response has no box
    pred = extract_boxed_answer(solution_str)
    ok = pred is not None and pred != "" and any(
        answers_equivalent(pred, g, timeout_s=timeout_s) for g in gold_answers(ground_truth))
    return {"score": 1.0 if ok else 0.0, "acc": 1.0 if ok else 0.0, "pred": pred}
