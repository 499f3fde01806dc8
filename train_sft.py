"""Supervised fine-tuning on prompt/response pairs (the warm-start before RL).

Reuses the RL stack's model loading, FSDP2 sharding, optimizer, schedule and HF export.

    torchrun --nproc_per_node=2 train_sft.py --config configs/quickstart_sft.yaml
"""

from rlhf.cli import load, parse_args, run_main


def main() -> None:
    args = parse_args(__doc__)
    from rlhf.sft import SFTConfig, run_sft, validate_sft

    cfg = load(args, cls=SFTConfig, check=validate_sft)
    if args.dry_run:
        print("dry run OK: config is valid")
        return
    run_sft(cfg)


if __name__ == "__main__":
    run_main(main)
