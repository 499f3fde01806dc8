"""Shared command line of the entry scripts: --config FILE, --dry-run, dotted overrides.

A user error (bad key, missing file, malformed data, impossible layout) ends the run
with one line ``error: ...`` and exit status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from rlhf.config.load import load_config
from rlhf.config.verl import check_launch_world
from rlhf.data.dataset import DataError
from rlhf.rewards.scoring import RewardFailureError
from rlhf.schema.config import ConfigError, describe
from rlhf.train.checkpoint import CheckpointError
from rlhf.train.optim import NonFiniteError
from rlhf.train.write_guard import SaveFailedError

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, CheckpointError, NonFiniteError, RewardFailureError,
               SaveFailedError)


def parse_args(description: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="yaml config file")
    ap.add_argument("--config-path", "-cp", dest="config_path",
                    help="Hydra's (verl): directory of --config-name (default: the current directory)")
    ap.add_argument("--config-name", "-cn", dest="config_name",
                    help="Hydra's (verl): the yaml <config-path>/<name>.yaml; its hydra: block is ignored and its "
                         "defaults: list resolved (rlhf/verl_compat.py)")
    ap.add_argument("--dry-run", action="store_true", help="validate config, data and layout, then exit")
    ap.add_argument("--list-keys", action="store_true", help="print every config key with its default and doc")
    ap.add_argument("--device-memory", help="with --dry-run: say whether the planned peak fits, e.g. 80GiB")
    ap.add_argument("--world-size", type=int, default=0,
                    help="with --dry-run: plan memory for this many ranks (default: the launched world size)")
    ap.add_argument("--simulate", action="store_true",
                    help="with --dry-run: run one rank of --world-size (one of every pipeline stage) on a fake process "
                         "group with fake tensors (python -m rlhf.simulate) after the plan, and print its memory and "
                         "collectives")
    ap.add_argument("--plan-device", choices=("cuda", "cpu"), default=None,
                    help="with --dry-run: device to plan for (default: the run's trainer.device)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6 parallel.tp=2")
    # Intermixed: overrides may come before, between and after the flags.
    return ap.parse_intermixed_args(argv)


def run_main(fn: Callable[[], object]) -> None:
    """Run `fn`, turning user errors into one clear line; tear down the process group."""
    import torch.distributed as dist

    try:
        fn()
    except USER_ERRORS as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, SaveFailedError) and dist.is_initialized():
            dist.barrier()  # raised on every rank: none exits (and has torchrun stop rank 0) before the line
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)
    if dist.is_initialized():
        dist.destroy_process_group()


def load(args: argparse.Namespace, **kw):
    if args.list_keys:
        print("\n".join(describe(kw.get("cls")) if kw.get("cls") else describe()))
        sys.exit(0)
    return load_config(config_file(args), args.overrides, **kw)


def config_file(args: argparse.Namespace):
    """``--config FILE``, or Hydra's ``--config-path DIR --config-name NAME`` (verl's form) as a file."""
    from pathlib import Path

    from rlhf.schema.config import ConfigError

    if not getattr(args, "config_name", None):
        if getattr(args, "config_path", None):
            raise ConfigError("--config-path needs --config-name (Hydra's pair; or give the file with --config)")
        return args.config
    if args.config:
        raise ConfigError("give --config FILE or --config-path/--config-name, not both")
    name = args.config_name if args.config_name.endswith((".yaml", ".yml")) else args.config_name + ".yaml"
    path = Path(args.config_path or ".") / name
    if not path.is_file() and Path(name).stem == "ppo_trainer":
        return None  # verl's own trainer defaults: the defaults here (and verl's where they differ) apply
    if not path.is_file():
        raise ConfigError(f"--config-name {args.config_name}: no file {path} (--config-path {args.config_path or '.'})")
    return str(path)


def print_memory_plan(cfg, args) -> bool:
    """--dry-run: print the memory plan (rank 0); False when the run cannot be checked further here:
    model.path holds only a config.json (a planning config) or --world-size is not this world."""
    from pathlib import Path

    import torch

    from rlhf.models.loading import check_rollout_support
    from rlhf.planner import format_plan, parse_bytes, plan_from_config

    # What the sampler cannot run is said first: the plan of such a run would be moot.
    check_rollout_support(cfg.model.path, cfg.model.trust_remote_code,
                          cfg.data.max_prompt_length + cfg.data.max_response_length,
                          rollout_tp=cfg.rollout.tp, quantization=cfg.rollout.quantization,
                          announce=int(os.environ.get("RANK", "0")) == 0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan_world = args.world_size or world
    device = args.plan_device or ("cuda" if cfg.trainer.device == "cuda" or
                                  (cfg.trainer.device == "auto" and torch.cuda.is_available()) else "cpu")
    plan = plan_from_config(cfg, world_size=plan_world, device=device)
    mem = parse_bytes(args.device_memory) if args.device_memory else None
    tok_dir = Path(cfg.model.tokenizer_path or cfg.model.path)
    config_only = not any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_plan(plan, mem), flush=True)
        if config_only:
            print(f"[plan] {tok_dir} has no tokenizer (a config.json-only directory): tokenizer, data and "
                  "process-group checks skipped", flush=True)
        elif plan_world != world:
            print(f"[plan] planned for --world-size {plan_world}, launched with {world}: layout checks "
                  "against this world skipped", flush=True)
            check_tokenizer_and_data(cfg)
    return not config_only and plan_world == world


def simulate_main(cfg, args) -> None:
    """--dry-run --simulate: one rank of the planned world (of every pipeline stage) run on a fake process group."""
    import torch.distributed as dist

    from rlhf.simulate import format_simulation, simulate_stages

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--simulate runs in one process: launch it with python, not torchrun")
    import torch

    # the device the memory plan above used, so that the two tables compare
    device = args.plan_device or ("cuda" if cfg.trainer.device == "cuda" or
                                  (cfg.trainer.device == "auto" and torch.cuda.is_available()) else "cpu")
    sims = simulate_stages(cfg, world=args.world_size or 1, device=device)
    print("\n".join(format_simulation(sim) for sim in sims), flush=True)


def check_tokenizer_and_data(cfg) -> None:
    """The dry-run checks that need no process group: the trainer's start-up checks (names, reward
    function, LoRA layout), tokenizer, prompt files and the batch size against them."""
    from rlhf.config.checks import check_startup
    from rlhf.models.loading import load_tokenizer
    from rlhf.train.prompts import load_data, make_loader

    check_startup(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code,
                               key="model.tokenizer_path" if cfg.model.tokenizer_path else "model.path")
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if files:
            ds = load_data(cfg, files, tokenizer)
            print(f"[rlhf] {key}: {ds.stats.summary()}", flush=True)
            if key == "data.train_files":
                make_loader(cfg, len(ds))
    print("dry run OK: config and data are valid; the layout was checked by the memory plan", flush=True)


def train_main(doc: str, trainer_factory: Callable) -> None:
    """Body of the RL entry scripts: parse, build the trainer (all ranks), dry-run or fit."""

    def main() -> None:
        args = parse_args(doc)
        cfg = load(args)
        # verl's trainer.nnodes x n_gpus_per_node: checked against the launch; a 1-process dry run plans for it
        planned = check_launch_world(cfg, int(os.environ.get("WORLD_SIZE", "1")), dry_run=args.dry_run)
        args.world_size = args.world_size or planned
        if args.dry_run and args.simulate:
            print_memory_plan(cfg, args)
            simulate_main(cfg, args)
            return
        if args.dry_run and not print_memory_plan(cfg, args):
            return
        if cfg.trainer.mode in ("one_step_off", "fully_async"):
            from rlhf.train.async_rl import run_async

            trainer = run_async(cfg, trainer_factory, dry_run=args.dry_run)
            if args.dry_run and trainer is not None and trainer.env.is_main:
                print("dry run OK: config, data and both roles' layouts are valid")
            return
        trainer = trainer_factory(cfg, dry_run=args.dry_run)
        if args.dry_run:
            if trainer.env.is_main:
                print("dry run OK: config, data and parallel layout are valid")
            return
        trainer.fit()

    run_main(main)
