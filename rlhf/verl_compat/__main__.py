"""``python -m rlhf.verl_compat ARGS``: print the native overrides of a verl command line.

The translation itself is :mod:`rlhf.config.verl` (config loading runs it on every yaml file and
override); this entry only reads a command line and prints the result.
"""

from __future__ import annotations

import argparse
import sys

from rlhf.config.load import parse_override
# The translator's own dotted-tree helpers, so that the printed overrides are the keys it writes.
from rlhf.config.verl import _get, _set, translate
from rlhf.schema.config import ConfigError


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and v and prefix + k != "trainer.alerts":
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={v!r}" if isinstance(v, str) and (" " in v or not v) else f"{prefix}{k}={v}")
    return out


def main(argv=None) -> None:
    """Print the native overrides of a verl command line (nothing is run)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("overrides", nargs="*", help="verl overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-6")
    args = ap.parse_args(argv)
    tree: dict = {}
    try:
        for ov in args.overrides:
            keys, value = parse_override(ov)
            _set(tree, ".".join(keys), value)
        tree = translate(tree)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    script = "train_ppo.py" if _get(tree, "algorithm.adv_estimator", "grpo") == "gae" else "train_grpo.py"
    print(f"python {script} " + " ".join(_flatten(tree)))


if __name__ == "__main__":
    main()
