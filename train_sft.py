"""Supervised fine-tuning on prompt/response pairs (the warm-start before RL).

Reuses the RL stack's model loading, FSDP2 sharding, optimizer, schedule and HF export.

    torchrun --nproc_per_node=2 train_sft.py --config configs/quickstart_sft.yaml
"""

import os

from rlhf.cli import load, parse_args, run_main


def main() -> None:
    args = parse_args(__doc__)
    from rlhf.train.sft import SFTConfig, run_sft, validate_sft

    cfg = load(args, cls=SFTConfig, check=validate_sft)
    run_sft(cfg, dry_run=args.dry_run)
    if args.dry_run and int(os.environ.get("RANK", "0")) == 0:
        print("dry run OK: config, model directory, tokenizer, data and layout are valid")


if __name__ == "__main__":
    run_main(main)
