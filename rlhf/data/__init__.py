"""Prompt data: verl-schema datasets, the resumable batch order, the synthetic task."""

from rlhf.data.dataset import DataError, DatasetStats, PromptDataset, PromptExample, load_prompt_dataset
from rlhf.data.loader import PromptLoader, shard

__all__ = [
    "DataError",
    "DatasetStats",
    "PromptDataset",
    "PromptExample",
    "PromptLoader",
    "build_char_tokenizer",
    "load_prompt_dataset",
    "make_addition_task",
    "shard",
]


def __getattr__(name: str):
    # Lazy: importing `synthetic` here eagerly makes `python -m rlhf.data.synthetic` warn
    # (the module would already be in sys.modules), and the tokenizer pulls in transformers.
    if name == "make_addition_task":
        from rlhf.data.synthetic import make_addition_task

        return make_addition_task
    if name == "build_char_tokenizer":
        from rlhf.data.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer
    raise AttributeError(f"module 'rlhf.data' has no attribute '{name}'")
