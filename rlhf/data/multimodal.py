"""Images in verl's multimodal schema, and the processor outputs kept per row.

A verl multimodal row holds an ``images`` column (a list of image bytes, ``{"bytes": ..., "path": ...}``
dicts as parquet stores them, file paths, or PIL images) and one ``<image>`` placeholder in the prompt
per image, in order. The model's processor (transformers' ``AutoProcessor``) expands each placeholder
to the image's tokens and returns, per row, ``pixel_values [patches, C * temporal * patch**2]`` and
``image_grid_thw [images, 3]``. The project keeps those two tensors with the row
(:class:`MultiModalInputs`, a plain dict so that every per-row list of the batch types carries it
through batching, packing, regrouping and the async exchanges) and concatenates them, in row order,
for a forward pass (:func:`collate_multi_modal`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import torch

IMAGE_PLACEHOLDER = "<image>"  # verl's placeholder in the prompt text
# What the Qwen-VL chat templates put for one image; the processor expands the pad token.
QWEN_IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"

MultiModalInputs = dict  # {"pixel_values": Tensor [p, d], "image_grid_thw": LongTensor [k, 3]}


def decode_image(item: Any, base_dir: Path | None = None):
    """A PIL RGB image from a verl ``images`` entry: bytes, ``{"bytes", "path"}``, a path or an image.

    Raises:
        ValueError: the entry is of another type, or its file / bytes cannot be read as an image.
    """
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path") or item.get("image")
    try:
        if isinstance(item, (bytes, bytearray)):
            return Image.open(io.BytesIO(item)).convert("RGB")
        if isinstance(item, str):
            p = Path(item).expanduser()
            if not p.is_absolute() and base_dir is not None:
                p = base_dir / p
            return Image.open(p).convert("RGB")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read image: {type(e).__name__}: {e}") from None
    raise ValueError(f"image entry is a {type(item).__name__}; expected bytes, {{'bytes': ...}}, a path or an image")


def expand_placeholders(text: str, n_images: int, image_text: str = QWEN_IMAGE_TEXT) -> str:
    """``text`` with each ``<image>`` replaced by the model's image text; the count must be ``n_images``."""
    found = text.count(IMAGE_PLACEHOLDER)
    if found != n_images:
        raise ValueError(f"the prompt has {found} '{IMAGE_PLACEHOLDER}' placeholder(s) for {n_images} image(s)")
    return text.replace(IMAGE_PLACEHOLDER, image_text)


def image_tokens_kept(full_ids: Sequence[int], kept_ids: Sequence[int], image_token_ids: set[int]) -> bool:
    """True when truncating ``full_ids`` to ``kept_ids`` removed no image token (a prompt whose image
    is cut no longer matches its ``pixel_values``; it is filtered, never cut)."""
    n_full = sum(1 for t in full_ids if t in image_token_ids)
    return n_full == sum(1 for t in kept_ids if t in image_token_ids)


def process_images(processor: Any, text: str, images: list) -> tuple[list[int], MultiModalInputs]:
    """Token ids and :class:`MultiModalInputs` of one prompt ``text`` (placeholders already expanded)."""
    out = processor(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not images:
        return ids, None
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}


def collate_multi_modal(rows: Sequence[MultiModalInputs | None]) -> MultiModalInputs | None:
    """The inputs of a forward over ``rows`` in order: ``pixel_values`` and ``image_grid_thw``
    concatenated (rows without images add nothing); None when no row holds an image.

    The order is the order of the rows' image tokens in a padded or packed batch of the same rows,
    which is how the model matches image features to image tokens.
    """
    held = [r for r in rows if r is not None]
    if not held:
        return None
    return {"pixel_values": torch.cat([r["pixel_values"] for r in held]),
            "image_grid_thw": torch.cat([r["image_grid_thw"] for r in held])}
