"""The project's own tiny vision-language models (no hub download): Qwen2-VL / Qwen2.5-VL / Qwen3-VL shaped.

A tiny random ``Qwen2_5_VLForConditionalGeneration`` (or the Qwen2-VL / Qwen3-VL class)
with the character tokenizer of ``rlhf.data`` plus Qwen's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``) and a small image
processor (patch 14 -> 4, merge 2), written as an HF directory (config, weights, tokenizer and
processor) so that ``AutoProcessor`` / ``from_pretrained`` load it like a downloaded checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rlhf.data.char_tokenizer import build_char_tokenizer

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_vl")

# Small images: a 28x28 picture is 7x7 patches of 4 px -> not divisible by merge 2, so the image
# processor resizes to multiples of patch * merge = 8 px within [min_pixels, max_pixels].
PATCH, MERGE, TEMPORAL = 4, 2, 2


def build_vlm_tokenizer():
    """The character tokenizer with Qwen's vision tokens added as single-id special tokens."""
    tok = build_char_tokenizer()
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    return tok


def build_processor(tok, *, min_pixels: int = 8 * 8, max_pixels: int = 32 * 32):
    """A Qwen2.5-VL processor over ``tok``: images of up to ``max_pixels`` become at most
    ``max_pixels / (PATCH * MERGE)^2`` image tokens (16 for 32x32)."""
    from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor

    from rlhf.models.processor import QwenVLImageProcessor

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    ip = Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, size=size)
    return QwenVLImageProcessor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template)


def tiny_vlm_config(tok, family: str = "qwen2_5_vl", *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    vision_hidden: int = 32, vision_depth: int = 2, max_positions: int = 512):
    """An HF config of a tiny ``family`` VLM whose special token ids are ``tok``'s."""
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("vision_start_token_id", VISION_START), ("image_token_id", IMAGE_PAD),
            ("vision_end_token_id", VISION_END), ("video_token_id", VIDEO_PAD))}
    head_dim = hidden_size // num_heads
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_positions, tie_word_embeddings=True,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    # mrope sections (t, h, w) in rotary half-dims: they sum to head_dim / 2.
    section = [head_dim // 4 - 2 * (head_dim // 16), head_dim // 16 * 1, head_dim // 16 * 1]
    section[0] = head_dim // 2 - section[1] - section[2]
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
        vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                      num_heads=2, out_hidden_size=hidden_size, patch_size=PATCH, spatial_merge_size=MERGE,
                      temporal_patch_size=TEMPORAL, window_size=PATCH * MERGE * 2,
                      fullatt_block_indexes=[vision_depth - 1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
        vision = dict(depth=vision_depth, embed_dim=vision_hidden, hidden_size=hidden_size, mlp_ratio=2, num_heads=2,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                                   "mrope_interleaved": True}
        text["head_dim"] = head_dim
        vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                      num_heads=2, out_hidden_size=hidden_size, patch_size=PATCH, spatial_merge_size=MERGE,
                      temporal_patch_size=TEMPORAL, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")


def build_tiny_vlm(family: str = "qwen2_5_vl", *, seed: int = 0, init_std: float | None = 0.2, **kw):
    """(model, processor) of a random tiny ``family`` VLM, fp32, eval mode, sdpa attention.

    ``init_std``: every matrix drawn from N(0, init_std) (tests: large random weights make every
    weight matter); None keeps transformers' own init (a model to train: the quickstart)."""
    from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
                              Qwen3VLForConditionalGeneration)

    tok = build_vlm_tokenizer()
    cfg = tiny_vlm_config(tok, family, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    cls = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration,
           "qwen2_vl": Qwen2VLForConditionalGeneration}[family]
    model = cls(cfg).eval()
    if init_std is None:
        return model, build_processor(tok)
    with torch.no_grad():  # HF's init of the tiny towers leaves many exact zeros: make every weight matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, init_std)
    return model, build_processor(tok)


def write_tiny_vlm(out_dir: str, family: str = "qwen2_5_vl", *, seed: int = 0, init_std: float | None = 0.2,
                   **kw) -> Path:
    """Write a random tiny VLM with its processor (tokenizer included) to ``out_dir``."""
    model, processor = build_tiny_vlm(family, seed=seed, init_std=init_std, **kw)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vision-hidden", type=int, default=32)
    ap.add_argument("--hf-init", action="store_true",
                    help="transformers' own init (a model to train) instead of N(0, 0.2) weights (tests)")
    a = ap.parse_args(argv)
    path = write_tiny_vlm(a.out, a.family, seed=a.seed, init_std=None if a.hf_init else 0.2,
                          hidden_size=a.hidden_size, num_layers=a.layers, intermediate_size=2 * a.hidden_size,
                          vision_hidden=a.vision_hidden)
    n = sum(p.numel() for p in build_tiny_vlm(a.family, init_std=None, hidden_size=a.hidden_size,
                                              num_layers=a.layers, intermediate_size=2 * a.hidden_size,
                                              vision_hidden=a.vision_hidden)[0].parameters())
    print(f"wrote tiny {a.family} ({n / 1e6:.2f}M params) with its processor to {path}")


if __name__ == "__main__":
    main()
