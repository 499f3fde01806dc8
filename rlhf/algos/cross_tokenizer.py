"""A teacher with another tokenizer: its log-probs mapped back to the student's tokens by character spans.

The student's trajectory (prompt + response token ids) is turned into text, one piece per
student token, so student token ``i`` covers the characters ``[s_i, e_i)`` of that text. The
teacher tokenizes the same text (with character offsets) and scores it: teacher token ``j``
covers ``[a_j, b_j)`` and has ``log q(tok_j | tok_<j)``.

A student token is *cleanly mapped* when the teacher tokens starting at ``s_i`` tile its span
exactly: ``a_{j0} = s_i``, ``b_{j} = a_{j+1}`` and ``b_{jk} = e_i``. Then, by the chain rule,
the teacher's log-probability of emitting the student token's characters at that point is the
sum over those teacher tokens (NeMo-RL's and TRL GOLD's cross-tokenizer rule):

    log q(student token i) = sum_{j = j0..jk} log q(tok_j | tok_<j).

A teacher token that crosses a student token boundary (it merges the end of one student token
with the start of the next) leaves both without a per-token value: those student tokens are
*masked* (no distillation signal) and *counted* (``distill/unmapped_tokens``). So are tokens that
decode to no text, and a first teacher token, which has no context to be scored in.
Rule of thumb: a teacher whose tokens are never coarser than the student's (e.g. a character
teacher) maps everything; a coarser teacher maps what its merges leave aligned.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["piece_spans", "map_by_spans"]


def piece_spans(pieces: Sequence[str], start: int = 0) -> list[tuple[int, int]]:
    """Character spans ``[s, e)`` of consecutive text pieces, from ``start``: the spans of the
    student's tokens when the text is the concatenation of their decoded pieces."""
    spans, pos = [], start
    for p in pieces:
        spans.append((pos, pos + len(p)))
        pos += len(p)
    return spans


def map_by_spans(student_spans: Sequence[tuple[int, int]], teacher_spans: Sequence[tuple[int, int]],
                 teacher_log_probs: Sequence[float]) -> tuple[list[float], list[bool]]:
    """Teacher log-probs per student token (module docstring): ``(values, valid)``, one per student span.

    ``teacher_log_probs[j]`` belongs to ``teacher_spans[j]``; a NaN marks a teacher token without a
    score (the first token, the prompt). ``valid[i]`` is False where student token ``i`` has no
    clean mapping; its value is then 0.0. Teacher tokens with empty spans are skipped. O(n + m).
    """
    if len(teacher_spans) != len(teacher_log_probs):
        raise ValueError(f"map_by_spans: {len(teacher_spans)} teacher spans but {len(teacher_log_probs)} log-probs")
    starts = {}
    for j, (a, b) in enumerate(teacher_spans):
        if b > a and a not in starts:
            starts[a] = j
    values, valid = [], []
    for s, e in student_spans:
        j = starts.get(s) if e > s else None
        total, pos, ok = 0.0, s, j is not None
        while ok and pos < e:
            if j >= len(teacher_spans):
                ok = False
                break
            a, b = teacher_spans[j]
            if b <= a:  # an empty span (some special tokens): no characters, no score of its own here
                j += 1
                continue
            lp = teacher_log_probs[j]
            if a != pos or b > e or lp is None or math.isnan(lp):
                ok = False
                break
            total += lp
            pos, j = b, j + 1
        values.append(total if ok else 0.0)
        valid.append(ok)
    return values, valid
