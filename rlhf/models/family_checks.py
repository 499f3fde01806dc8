"""What ``scripts/generic_survey.py`` found, per generic-path family of transformers 5.24 (2026-11-28).

The survey builds each family on a tiny random fp32 config and compares the generic path's greedy tokens
and log-probs with HF ``generate`` / forward (1e-5). ``rlhf.models.generic`` refuses the families of
``DIFFERS`` (one line: what differed) and marks the table with ``EQUAL`` / ``UNCHECKED``. Re-run the
survey after upgrading transformers and paste its results here.
"""

from __future__ import annotations

# equal to HF on a tiny config
EQUAL: frozenset[str] = frozenset()

# the generic path computed something else than HF (the reason it is refused)
DIFFERS: dict[str, str] = {}

# the survey could not build a tiny config of the family (its shrinking does not fit the config class), so
# the generic path is not checked for it; it still runs, with the build-time probe's checks
UNCHECKED: dict[str, str] = {}
