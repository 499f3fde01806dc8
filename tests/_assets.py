"""Tiny model and task directories the multi-process and end-to-end tests build (no downloads)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_assets(d: Path, *, num_layers: int = 2, n_train: int = 64, n_val: int = 16, n_sft: int = 0) -> Path:
    """`d/model` (hidden 32, 4 heads, 2 kv heads, char tokenizer) and `d/data` (the addition task)."""
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model

    write_tiny_model(str(d / "model"), hidden_size=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                     intermediate_size=64)
    make_addition_task(d / "data", n_train=n_train, n_val=n_val, n_sft=n_sft, seed=0)
    return d
