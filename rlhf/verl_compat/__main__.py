"""``python -m rlhf.verl_compat ARGS``: print the native command of a verl command line.

The translation itself is :mod:`rlhf.config.verl` (config loading runs it on every yaml file and
override); this entry only reads a command line and prints the result: the command alone on
stdout, quoted so that it runs when pasted into a shell, and the ``[verl]`` lines on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys

import yaml

from rlhf.config.load import parse_override
# The translator's own dotted-tree helpers, so that the printed overrides are the keys it writes.
from rlhf.config.verl import _get, _set, translate
from rlhf.schema.config import ConfigError


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    """``key=value`` overrides of a key tree, each value in yaml flow style (as parse_override reads it)."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and v and prefix + k != "trainer.alerts":
            out += _flatten(v, f"{prefix}{k}.")
        else:
            text = yaml.safe_dump(v, default_flow_style=True, width=1 << 20)
            text = text.removesuffix("\n...\n").strip()  # a bare scalar ends with yaml's document marker
            out.append(f"{prefix}{k}={text}")
    return out


def shell_command(tree: dict, script: str) -> str:
    """The native command line, each override quoted for a POSIX shell where it needs it."""
    return f"python {script} " + " ".join(shlex.quote(o) for o in _flatten(tree))


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
        with contextlib.redirect_stdout(sys.stderr):  # the [verl] lines; stdout is the command alone
            tree = translate(tree)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    script = "train_ppo.py" if _get(tree, "algorithm.adv_estimator", "grpo") == "gae" else "train_grpo.py"
    print(shell_command(tree, script))


if __name__ == "__main__":
    main()
