"""Shared command line of the entry scripts: --config FILE, --dry-run, dotted overrides.

A user error (bad key, missing file, malformed data, impossible layout) ends the run
with one line ``error: ...`` and exit status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from rlhf.config import ConfigError, describe, load_config
from rlhf.data.dataset import DataError

USER_ERRORS = (ConfigError, DataError, FileNotFoundError)


def parse_args(description: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="yaml config file")
    ap.add_argument("--dry-run", action="store_true", help="validate config, data and layout, then exit")
    ap.add_argument("--list-keys", action="store_true", help="print every config key with its default and doc")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6 parallel.tp=2")
    return ap.parse_args(argv)


def run_main(fn: Callable[[], object]) -> None:
    """Run `fn`, turning user errors into one clear line; tear down the process group."""
    import torch.distributed as dist

    try:
        fn()
    except USER_ERRORS as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)
    if dist.is_initialized():
        dist.destroy_process_group()


def load(args: argparse.Namespace, **kw):
    if args.list_keys:
        print("\n".join(describe(kw.get("cls")) if kw.get("cls") else describe()))
        sys.exit(0)
    return load_config(args.config, args.overrides, **kw)


def train_main(doc: str, trainer_factory: Callable) -> None:
    """Body of the RL entry scripts: parse, build the trainer (all ranks), dry-run or fit."""

    def main() -> None:
        args = parse_args(doc)
        trainer = trainer_factory(load(args), dry_run=args.dry_run)
        if args.dry_run:
            if trainer.env.is_main:
                print("dry run OK: config, data and parallel layout are valid")
            return
        trainer.fit()

    run_main(main)
