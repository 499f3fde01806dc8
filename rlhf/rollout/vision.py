"""Vision-language prompts on the built-in sampler (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The sampler's functional decoder runs the *language model* of a Qwen-VL checkpoint: its weights
``model.language_model.*`` are renamed to a text LM's ``model.*`` (:func:`split_vlm_weights`) and its
``text_config`` is read as the text family it is (:func:`text_config`: Qwen2-VL / Qwen2.5-VL -> qwen2,
Qwen3-VL -> qwen3).
What differs from a text prompt happens at prefill only:

* the vision tower (transformers' own module, built from ``vision_config`` and loaded with the
  rollout weights ``model.visual.*``) runs once per ``generate`` call on all the images of the call
  (one batched forward), and each image's merged features replace the embeddings of its image tokens
  (``embeds[ids == image_token_id] = features``, as transformers' ``masked_scatter``);
* the rotary phases of the prompt come from the project's M-RoPE positions
  (:func:`rlhf.models.mrope.mrope_position_ids`, ``[3, T]``): rotary frequency ``j`` reads the
  temporal, height or width position by its ``mrope_section`` (HF's ``recomposition_frequencies``:
  consecutive sections for Qwen2 / 2.5-VL, interleaved ``t h w t h w ...`` for Qwen3-VL);
* Qwen3-VL's deepstack features (one per ``deepstack_visual_indexes`` layer of the tower) are added
  to the image tokens' hidden states after the first decoder layers, as transformers does.

Decoding then continues on text positions: a token at cache position ``p`` rotates by ``p + delta``
(``delta = max position + 1 - prompt length``, transformers' ``rope_deltas``); with the three
positions equal M-RoPE is plain RoPE, so the decode step only shifts its rope rows. The K/V cache
keeps the cache positions, so attention, paging and prefix sharing are unchanged (a prompt's
samples share its blocks: the key is the prompt, images included). Image / video placeholder ids
are never sampled (their logits are masked before the draw; the recorded log-probs stay the
policy's untruncated ones, like top-k / top-p).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from rlhf.models.arch import VL_TEXT_FAMILY, check_model_type, vl_text_config
from rlhf.models.mrope import MRopeSpec, mrope_position_ids

_LM_PREFIX, _VISUAL_PREFIX = "model.language_model.", "model.visual."


def is_vlm(config: Any) -> bool:
    return getattr(config, "model_type", None) in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def text_config(config: Any) -> Any:
    """The language model's config, read as its text family; an unsupported VLM refused in one line."""
    if config.model_type not in VL_TEXT_FAMILY:
        check_model_type(config)  # raises, naming what is missing
    return vl_text_config(config)


def split_vlm_weights(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A Qwen-VL state dict -> (language model under text-LM names, vision tower under its own names).

    ``model.language_model.X`` -> ``model.X``; ``model.visual.X`` -> ``X``; ``lm_head.weight`` kept.
    Pops from ``weights`` (the caller's dict is handed over)."""
    lm, visual = {}, {}
    for name in list(weights):
        t = weights.pop(name)
        if name.startswith(_VISUAL_PREFIX):
            visual[name[len(_VISUAL_PREFIX):]] = t
        elif name.startswith(_LM_PREFIX):
            lm["model." + name[len(_LM_PREFIX):]] = t
        else:
            lm[name] = t
    if not visual:
        raise ValueError("rollout weights of a vision-language model hold no vision tower (model.visual.*): "
                         "the reshard must gather it too")
    return lm, visual


def build_vision_tower(config: Any, weights: dict[str, Tensor], device: torch.device, dtype: torch.dtype):
    """transformers' vision tower of ``config`` holding ``weights`` (eval mode, ``dtype``, on ``device``)."""
    if config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as cls
    elif config.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls
    vcfg = copy.copy(config.vision_config)
    vcfg._attn_implementation = "sdpa"
    with torch.device(device):  # built where it runs; its random init is overwritten just below
        tower = cls._from_config(vcfg, dtype=dtype)
    tower.load_state_dict(weights, strict=True)
    return tower.eval()


def mrope_selector(config: Any, half: int) -> Tensor:
    """``[half]`` long: which position stream (0 t, 1 h, 2 w) rotary frequency ``j`` reads:
    ``mrope_section`` consecutive sections (Qwen2-VL / Qwen2.5-VL), or interleaved (Qwen3-VL: h on
    ``j % 3 == 1`` below ``3 * section[1]``, w on ``j % 3 == 2`` below ``3 * section[2]``, t elsewhere)."""
    params = getattr(config.text_config, "rope_parameters", None) or {}
    section = list(params.get("mrope_section") or [])
    if sum(section) != half:
        raise ValueError(f"rope_parameters.mrope_section {section} must sum to head_dim / 2 = {half}")
    if config.model_type != "qwen3_vl":
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    j = torch.arange(half)
    sel = torch.zeros(half, dtype=torch.long)
    sel[(j % 3 == 1) & (j < 3 * section[1])] = 1
    sel[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return sel


def mrope_tables(pos: Tensor, inv_freq: Tensor, select: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin ``[T, R]`` of positions ``pos [3, T]`` (``rlhf.models.decoder.rope_tables``'s
    layout: fp32, ``sin[:R/2]`` negated, then cast). ``inv_freq [R/2]``, ``select [R/2]`` (:func:`mrope_selector`)."""
    freqs = pos.float()[:, :, None] * inv_freq.float()[None, None, :]  # [3, T, R/2]
    freqs = freqs.gather(0, select.to(pos.device)[None, None, :].expand(1, pos.shape[1], -1))[0]  # [T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sin[..., : freqs.shape[-1]].neg_()
    return cos.to(dtype), sin.to(dtype)


@dataclass
class PromptInputs:
    """Prefill inputs of one unit (a prompt, + generated tokens when recomputed): its embeddings (image
    features placed), rope rows and text delta."""

    embeds: Tensor  # [T, hidden]
    cos: Tensor  # [T, R]
    sin: Tensor  # [T, R]
    delta: int  # decode rope position = cache position + delta
    deepstack: Optional[Tensor] = None  # [L, T, hidden] Qwen3-VL: added after layer l (zeros off images)


@dataclass
class _Prompt:
    """What a prompt keeps for the whole call: its image tokens' features only (the dense embeddings are
    built per admission, so a call holds no ``[T, hidden]`` copy of every prompt), and its rope rows."""

    where: Optional[Tensor]  # [n] positions of the image tokens
    feats: Optional[Tensor]  # [n, hidden]
    deep: Optional[Tensor]  # [L, n, hidden] Qwen3-VL deepstack features of the image tokens
    cos: Tensor  # [T, R]
    sin: Tensor  # [T, R]
    delta: int


class VisionPrompts:
    """The multimodal prompts of one ``generate`` call: what prefill and decode need beyond token ids.

    A streaming run (``rlhf.rollout.stream``) reuses its prompt indices (group slots): :meth:`set`
    puts new prompts at them, and :meth:`refresh` recomputes their image features after a weight load."""

    def __init__(self, sampler: Any, prompts: list[list[int]], multi_modal: list[Optional[dict]]):
        cfg, dev = sampler.vlm_config, sampler.device
        if len(multi_modal) != len(prompts):
            raise ValueError(f"generate: {len(multi_modal)} multi_modal entries for {len(prompts)} prompts")
        self.sampler = sampler
        self.inv_freq = sampler._inv_freq[0].to(dev)
        self.select = mrope_selector(cfg, self.inv_freq.shape[0])
        self.spec = MRopeSpec.from_config(cfg)
        self.n_deep = len(getattr(cfg.vision_config, "deepstack_visual_indexes", None) or []) \
            if cfg.model_type == "qwen3_vl" else 0
        self.prompts: list[Optional[_Prompt]] = [None] * len(prompts)
        self.inputs: list[tuple[list[int], Optional[dict]]] = [([], None)] * len(prompts)  # what each was set from
        self.deltas = torch.zeros(len(prompts), dtype=torch.int64, device=dev)  # per prompt
        self.set(list(range(len(prompts))), prompts, multi_modal)

    def set(self, indices: list[int], prompts: list[list[int]], multi_modal: list[Optional[dict]]) -> None:
        """Prompts ``prompts`` (with their images) at ``indices`` (of the call's prompts): one tower forward
        for all their images."""
        sampler, spec, dev = self.sampler, self.spec, self.sampler.device
        with_images = [i for i, mm in enumerate(multi_modal) if mm is not None and mm["image_grid_thw"].numel()]
        features: list[Tensor] = []
        deep: list[list[Tensor]] = []  # per deepstack layer, per image
        if with_images:  # one tower forward for every image of the call
            pixels = torch.cat([multi_modal[i]["pixel_values"] for i in with_images]).to(dev, sampler.dtype)
            grids = torch.cat([multi_modal[i]["image_grid_thw"] for i in with_images]).to(dev)
            out = sampler.vision_tower(pixels, grid_thw=grids)
            merged = out.pooler_output if hasattr(out, "pooler_output") else out
            sizes = (grids.prod(-1) // spec.spatial_merge_size ** 2).tolist()
            features = list(merged.split(sizes))
            deep = [list(f.split(sizes)) for f in (getattr(out, "deepstack_features", None) or [])][:self.n_deep]
        k = 0
        for j, (i, ids) in enumerate(zip(indices, prompts)):
            ids_t = torch.tensor(ids, dtype=torch.long)
            mm = multi_modal[j]
            grid = mm["image_grid_thw"] if mm is not None and mm["image_grid_thw"].numel() else None
            pos, delta = mrope_position_ids(ids_t[None], None, grid, spec)  # [3, 1, T], [1]
            where = feats = stack = None
            if grid is not None:
                n_img = grid.shape[0]
                where = torch.nonzero(ids_t == spec.image_token_id).flatten().to(dev)
                feats = torch.cat(features[k:k + n_img]).to(sampler.dtype)
                if self.n_deep:
                    stack = torch.stack([torch.cat(d[k:k + n_img]) for d in deep]).to(sampler.dtype)
                k += n_img
            cos, sin = mrope_tables(pos[:, 0].to(dev), self.inv_freq, self.select, sampler.dtype)
            self.prompts[i] = _Prompt(where, feats, stack, cos, sin, int(delta[0]))
            self.inputs[i] = (list(ids), mm)
        self.deltas = torch.tensor([0 if p is None else p.delta for p in self.prompts], dtype=torch.int64, device=dev)

    def refresh(self, indices: list[int]) -> None:
        """Recompute the image features of the prompts at ``indices`` with the sampler's current vision
        tower (after a weight load)."""
        if indices:
            self.set(indices, [self.inputs[i][0] for i in indices], [self.inputs[i][1] for i in indices])

    def unit(self, prompt: int, tokens: list[int]) -> PromptInputs:
        """Inputs of ``tokens`` = prompt ``prompt`` (+ tokens generated after it: a recomputed sequence)."""
        p, s = self.prompts[prompt], self.sampler
        dev = p.cos.device
        embeds = s.embed(torch.tensor(tokens, dtype=torch.long, device=dev))  # [T, hidden]
        if p.where is not None:
            embeds[p.where] = p.feats
        deep = None
        if self.n_deep:
            deep = embeds.new_zeros((self.n_deep, len(tokens), embeds.shape[-1]))
            if p.where is not None:
                deep[:, p.where] = p.deep
        n = p.cos.shape[0]
        if len(tokens) == n:
            return PromptInputs(embeds, p.cos, p.sin, p.delta, deep)
        rope = torch.arange(n, len(tokens), device=dev) + p.delta  # generated tokens: text positions
        return PromptInputs(embeds, torch.cat((p.cos, s.cos[0, rope])), torch.cat((p.sin, s.sin[0, rope])), p.delta,
                            deep)
