"""The project's own small model for the CPU quickstart and tests (no hub download).

A Qwen2-architecture decoder with the character-level tokenizer of rlhf.data; written as
an HF directory (config + tokenizer, and random-initialised weights) so every loader in
the project treats it like any downloaded checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.data.char_tokenizer import build_char_tokenizer


def tiny_qwen2_config(vocab_size: int, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 384, max_positions: int = 256,
                      pad_token_id: int = 0, eos_token_id: int = 1) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=True,
                       pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None,
                       use_cache=False)


def write_tiny_model(out_dir: str, *, seed: int = 0, **kw) -> Path:
    """Write tokenizer + randomly initialised tiny Qwen2 to `out_dir` (save_pretrained)."""
    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    cfg = tiny_qwen2_config(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw)
    model = Qwen2ForCausalLM(cfg)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def write_permuted_vocab_copy(src: str, out_dir: str) -> Path:
    """``src`` (a model with the char tokenizer) under another tokenizer: a char tokenizer whose characters
    take other ids (reversed order), with the embedding and output rows moved to match. It predicts
    exactly what ``src`` predicts while its vocabulary differs from ``src``'s: a teacher that takes the
    cross-tokenizer path of distillation (rlhf/train/distill.py) with every span mapped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.char_tokenizer import DEFAULT_CHARS

    old_vocab = AutoTokenizer.from_pretrained(src).get_vocab()
    new_tok = build_char_tokenizer(DEFAULT_CHARS[::-1])
    new_vocab = new_tok.get_vocab()
    if set(old_vocab) != set(new_vocab):
        raise ValueError(f"{src}: not the project's character tokenizer (other tokens)")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    perm = torch.tensor([old_vocab[t] for t, _ in sorted(new_vocab.items(), key=lambda kv: kv[1])])
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
        emb.copy_(emb[perm].clone())
        if not tied:
            head = model.get_output_embeddings().weight
            head.copy_(head[perm].clone())
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    new_tok.save_pretrained(out)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    path = write_tiny_model(a.out, seed=a.seed, hidden_size=a.hidden_size, num_layers=a.layers)
    n = sum(p.numel() for p in Qwen2ForCausalLM.from_pretrained(path).parameters())
    print(f"wrote tiny Qwen2 ({n / 1e6:.2f}M params) to {path}")


if __name__ == "__main__":
    main()
