"""rlhf: RL post-training of causal language models in plain PyTorch (SPMD, FSDP2, DTensor)."""

__version__ = "0.1.0"
