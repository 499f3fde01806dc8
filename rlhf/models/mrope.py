"""Multimodal rotary positions (M-RoPE) of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, for images.

Qwen-VL rotates each head with three position streams (temporal, height, width; Wang et al.
2024, "Qwen2-VL", sec. 2.1). A text token has the same position ``p`` in all three. An image of
``t x h x w`` merged patches (``h = grid_h / merge``, ``w = grid_w / merge``) that starts at
position ``s`` gives its patch ``(i, j, k)`` the positions ``(s + i, s + j, s + k)``, and the text
after it resumes at ``s + max(h, w)`` (transformers 5: ``current_pos += max(grid_h, grid_w) // merge``).
Padding gets position 0. The rope ``delta`` of a row, ``max position + 1 - real tokens``, is what a
decode step adds to its text position (``cache length + delta``).

For still images the three families agree (Qwen3-VL differs only for videos, whose frames it splits
by timestamps), so one function serves them; the tests compare it with each family's
``get_rope_index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class MRopeSpec:
    """What the position ids of a Qwen-VL config depend on."""

    image_token_id: int
    spatial_merge_size: int

    @classmethod
    def from_config(cls, config: Any) -> MRopeSpec:
        if getattr(config, "model_type", None) not in VL_MODEL_TYPES:
            raise NotImplementedError(f"multimodal rope: model_type {getattr(config, 'model_type', None)!r} is not "
                                      f"supported; supported: {', '.join(VL_MODEL_TYPES)}")
        return cls(image_token_id=int(config.image_token_id),
                   spatial_merge_size=int(config.vision_config.spatial_merge_size))


def is_vlm_config(config: Any) -> bool:
    return getattr(config, "model_type", None) in VL_MODEL_TYPES


def _row_positions(ids: Tensor, grids: Tensor, first: int, spec: MRopeSpec, where: str) -> tuple[Tensor, int]:
    """Positions ``[3, n]`` of one row's real tokens ``ids [n]`` whose images are ``grids[first:]``
    in order; returns them and the number of images the row used."""
    n = ids.shape[0]
    m = spec.spatial_merge_size
    img_pos = torch.nonzero(ids == spec.image_token_id, as_tuple=False).flatten().tolist()
    chunks, cur, i, ptr, k = [], 0, 0, 0, first
    while ptr < len(img_pos):
        if k >= grids.shape[0]:
            raise ValueError(f"{where}: more image tokens than images in image_grid_thw ({grids.shape[0]})")
        s = img_pos[ptr]
        gt, gh, gw = (int(x) for x in grids[k])
        t, h, w = gt, gh // m, gw // m
        size = t * h * w
        if ptr + size > len(img_pos) or img_pos[ptr + size - 1] != s + size - 1:
            raise ValueError(f"{where}: image {k} (grid {gt}x{gh}x{gw}) needs {size} consecutive image tokens "
                             f"from token {s}; the prompt was cut or does not match its images")
        if s > i:  # text before the image
            chunks.append(torch.arange(cur, cur + s - i).expand(3, -1))
            cur += s - i
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        chunks.append(torch.stack((tt, hh, ww)).reshape(3, -1) + cur)
        cur += max(h, w)
        i, ptr, k = s + size, ptr + size, k + 1
    if n > i:
        chunks.append(torch.arange(cur, cur + n - i).expand(3, -1))
    pos = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)
    return pos, k - first


def mrope_position_ids(input_ids: Tensor, attention_mask: Tensor | None, image_grid_thw: Tensor | None,
                       spec: MRopeSpec) -> tuple[Tensor, Tensor]:
    """M-RoPE position ids of a padded batch (left or right padding, any mix of image / text rows).

    Args:
        input_ids: ``[B, L]``.
        attention_mask: ``[B, L]`` (1 = real token) or None (every token real).
        image_grid_thw: ``[I, 3]`` the (t, h, w) patch grid of every image of the batch, in row-major
            order of their image tokens; None when no row holds an image.
        spec: the image token id and spatial merge size of the model.

    Returns:
        ``position_ids [3, B, L]`` (0 on padding) and ``deltas [B]`` (``max + 1 - real tokens``).

    Raises:
        ValueError: the image tokens of a row do not match its grids (a cut prompt), or the number of
            images differs from ``image_grid_thw``.
    """
    B, L = input_ids.shape
    grids = image_grid_thw.cpu() if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    ids_cpu = input_ids.cpu()
    mask = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.cpu().bool()
    out = torch.zeros(3, B, L, dtype=torch.long)
    deltas = torch.zeros(B, dtype=torch.long)
    used = 0
    for b in range(B):
        pos, k = _row_positions(ids_cpu[b][mask[b]], grids, used, spec, f"row {b}")
        used += k
        out[:, b, mask[b]] = pos
        deltas[b] = (int(pos.max()) + 1 if pos.numel() else 0) - pos.shape[1]
    if used != grids.shape[0]:
        raise ValueError(f"image_grid_thw has {grids.shape[0]} images but the batch's image tokens use {used}")
    return out.to(input_ids.device), deltas.to(input_ids.device)


def packed_mrope_position_ids(position_ids: Tensor, indices: Tensor, text_position_ids: Tensor) -> Tensor:
    """The ``[4, 1, total]`` position ids transformers' Qwen-VL text models take for a packed row:
    text positions first (what a varlen kernel reads sequence starts from), then the three M-RoPE
    streams of the real tokens, gathered from the padded ``position_ids [3, B, L]`` at the packed
    ``indices [total]`` (flat ``b * L + l``)."""
    mrope = position_ids.reshape(3, -1)[:, indices]  # [3, total]
    return torch.cat((text_position_ids.reshape(1, -1), mrope)).unsqueeze(1)
