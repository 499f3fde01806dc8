"""Prompt data: verl-schema datasets, the resumable batch order, the synthetic task."""

import importlib

# Every name is imported on first use (PEP 562), so that importing one light submodule
# (`rlhf.data.answers`, which reward workers use) does not pull in torch and pyarrow through
# `dataset`: a reward or tool worker is a fresh interpreter and must start in well under a second.
# `synthetic` is lazy for one more reason: importing it here would make `python -m
# rlhf.data.synthetic` warn (the module would already be in sys.modules).
_WHERE = {
    "DataError": "dataset", "DatasetStats": "dataset", "PromptDataset": "dataset", "PromptExample": "dataset",
    "load_prompt_dataset": "dataset", "PromptLoader": "loader", "shard": "loader",
    "make_addition_task": "synthetic", "build_char_tokenizer": "char_tokenizer",
}

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
    if name in _WHERE:
        return getattr(importlib.import_module(f"rlhf.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rlhf.data' has no attribute '{name}'")
