"""Shared pieces of the GPU tier: the marker that skips it without CUDA, and small models."""

from __future__ import annotations

import pytest
import torch
import transformers

# Every module of tests/gpu sets ``pytestmark = GPU``: selected by ``-m gpu`` and reported
# as skipped (never passed) on a machine with no visible CUDA device.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (GPU tier)"),
]

PAD = 0


def qwen2_model(dtype: torch.dtype, *, vocab: int = 4096, hidden: int = 256, layers: int = 4, seed: int = 0,
                init: float = 0.05) -> torch.nn.Module:
    """A random Qwen2-architecture model on the GPU. ``init`` (larger than HF's 0.02) makes the
    next-token distributions peaked, so greedy choices are not decided by rounding noise."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                   initializer_range=init, tie_word_embeddings=True, max_position_embeddings=1024)
    model = transformers.Qwen2ForCausalLM(cfg).to("cuda", dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def random_prompts(num: int, vocab: int, lo: int = 4, hi: int = 24, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
