"""Models and their layouts: loading, the process mesh (ParallelDims), parallelisation (FSDP2, TP, PP, SP,
activation checkpointing), LoRA, forward passes, the sampler's functional decoder and model families."""
