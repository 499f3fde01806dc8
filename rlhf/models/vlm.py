"""The inputs a Qwen-VL forward takes besides the tokens: images and multimodal positions.

The trainer's forwards (padded :func:`rlhf.models.logprobs.forward_log_probs`, padding-free
:func:`rlhf.models.packed.packed_forward_log_probs`) call transformers' ``*ForConditionalGeneration``
with the batch's ``pixel_values`` / ``image_grid_thw`` (the vision tower runs once per image of the
micro-batch and its features replace the image tokens' embeddings) and with position ids from the
project's own M-RoPE (:mod:`rlhf.models.mrope`), never from the model's ``get_rope_index``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from rlhf.data.multimodal import MultiModalInputs
from rlhf.models.mrope import MRopeSpec, mrope_position_ids, packed_mrope_position_ids


def root_config(model: nn.Module) -> Any:
    """The config of the outermost HF model inside ``model`` (through peft / FSDP wrappers)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m.config
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel")


def padded_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  multi_modal: MultiModalInputs | None) -> dict:
    """Keyword arguments of a padded forward: ``position_ids [3, B, L]`` (M-RoPE) and the images."""
    spec = MRopeSpec.from_config(root_config(model))
    grids = None if multi_modal is None else multi_modal["image_grid_thw"]
    pos, _ = mrope_position_ids(input_ids, attention_mask, grids, spec)
    kw: dict = {"position_ids": pos}
    if multi_modal is not None:
        kw["pixel_values"] = multi_modal["pixel_values"].to(input_ids.device)
        kw["image_grid_thw"] = grids.to(input_ids.device)
    return kw


def packed_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  multi_modal: MultiModalInputs | None, indices: torch.Tensor,
                  text_position_ids: torch.Tensor) -> dict:
    """Keyword arguments of a packed forward over the real tokens at ``indices``: ``position_ids
    [4, 1, total]`` (text positions, then M-RoPE) and the images (rows keep their order when
    packed, so the images stay in the order of their tokens)."""
    kw = padded_inputs(model, input_ids, attention_mask, multi_modal)
    kw["position_ids"] = packed_mrope_position_ids(kw["position_ids"], indices, text_position_ids)
    return kw



def dummy_vision_loss(model: nn.Module, device: torch.device) -> torch.Tensor | None:
    """``0 * sum(vision_tower(one dummy image))`` (a scalar), None for a text LM.

    Run in place of the images of a micro-batch that has none (:func:`dummy_image_forward`): it
    changes no value and no gradient, but the tower's FSDP2 unit all-gathers in forward and
    reduce-scatters in backward like on a rank that holds images.
    """
    from rlhf.models.loading import vision_tower

    visual = vision_tower(model)
    if visual is None:
        return None
    cfg = root_config(model).vision_config
    m = cfg.spatial_merge_size
    grid = torch.tensor([[1, m, m]], device=device)  # the smallest image: one merged token
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    out = visual(torch.zeros(m * m, width, device=device), grid_thw=grid)
    # every output the tower's parameters feed (Qwen3-VL: the deepstack features too), so that every
    # parameter gets a (zero) gradient on every rank
    total = out.pooler_output.float().sum()
    for f in getattr(out, "deepstack_features", None) or ():
        total = total + f.float().sum()
    return total * 0.0


@contextlib.contextmanager
def dummy_image_forward(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside, a forward of ``model`` (a Qwen-VL) runs the vision tower on a dummy image where the
    real images would run: just before the language model, whose input embeddings get ``+ 0 * features``.

    Why there: FSDP2 collectives must come in the same order on every rank. A rank with images runs
    the tower inside the model's forward, after the root unit's all-gather and before the decoder
    blocks'; running the dummy after the forward (or before it) would put the tower's all-gather
    elsewhere in the sequence and gloo / nccl would pair it with another unit's.
    """
    lm = next((m for n, m in model.named_modules() if n.endswith("language_model")), None)
    if lm is None:
        raise TypeError(f"{type(model).__name__}: no language_model module to run a dummy image before")

    def hook(_module, args, kwargs):
        extra = dummy_vision_loss(model, device)
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + extra.to(kwargs["inputs_embeds"].dtype)
        return args, kwargs

    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
