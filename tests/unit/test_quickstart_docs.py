"""The quickstart's duration is stated in launch/quickstart.sh and in the README: the same figure."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _minutes(path: Path) -> set[str]:
    return set(re.findall(r"[Aa]bout (\d+) minutes? on 2", path.read_text()))


def test_script_and_readme_state_the_same_duration():
    script, readme = _minutes(ROOT / "launch" / "quickstart.sh"), _minutes(ROOT / "README.md")
    assert len(script) == 1 and script == readme, (script, readme)
