"""Model loading, parallelisation (FSDP2, TP, PP, activation checkpointing), LoRA and forward passes."""
