"""The generic rollout path: an HF causal LM's own forward over the sampler's paged KV cache.

A model outside the fast families (``rlhf.models.generic.rollout_path``) is built as its
``AutoModelForCausalLM`` module with ``attn_implementation="rlhf_paged"``: every attention layer then
calls :func:`paged_attention_forward` (registered in transformers' ``AttentionInterface``) with its
rotated, normed q / k / v and its own settings (``scaling``, ``sliding_window``, ``softcap``,
``s_aux`` sinks). The mask builder finds no mask function under that name and builds nothing; the
function writes K/V into ``rlhf.rollout.kv_cache.PagedKVCache`` and attends the way the functional
decoder does, so the scheduler (continuous batching, preemption and recompute, prefix sharing,
chunked prefill) runs unchanged: this module offers ``prefill`` / ``prefill_chunk`` / ``decode`` with
``rlhf.models.decoder``'s signatures, and the sampler calls whichever backend its model runs on.

Layouts of the HF forward:

* prefill: the prompts packed into one row ``[1, Ttot]`` with per-prompt ``position_ids`` (the
  padding-free layout training uses); attention scatters q/k/v into the right-padded grid of
  ``decoder.prefill``; ``logits_to_keep`` = each prompt's last token, so no ``[Ttot, V]`` logits;
* chunked prefill: one prompt's chunk ``[1, c]`` at positions ``[start, start + c)`` over its cached K/V;
* decode: one token per slot, ``[B, 1]`` with ``position_ids = pos``: nothing mixes rows.

Which attention layer a call belongs to is the order of the calls within one forward (K/V caches are
numbered 0..L-1 by it). The cache's head count and width come from a one-token probe forward at build
time: where K and V widths differ (MLA) or layers differ in head width (Gemma 4's global layers), every
K / V is zero-padded to the widest (exact: zeros add nothing to q.k, and padded output columns are cut). The context
of the forward in flight is a ``ContextVar``, so nothing depends on a model passing kwargs through.

Not here: CUDA graphs, tensor- / expert-parallel rollout, speculative verification, VLM prompts and
per-slot state other than K/V (hybrids are refused at start-up, ``rlhf.models.generic``).
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from rlhf.models import arch

ATTN_IMPLEMENTATION = "rlhf_paged"
_CTX: contextvars.ContextVar["_Forward | None"] = contextvars.ContextVar("rlhf_paged_forward", default=None)


@dataclass
class _Forward:
    """What the attention calls of one forward need (set around the forward)."""

    mode: str  # "prefill", "chunk", "decode" or "probe"
    cache: Any = None
    layer: int = 0  # attention calls so far in this forward
    # prefill
    grid_index: Tensor | None = None
    width: int = 0
    num_prompts: int = 0
    index: Tensor | None = None
    rows: Tensor | None = None
    runs: list | None = None
    masks: Any = None
    # chunk
    slots: Tensor | None = None
    window: int = 0
    # decode
    plan: Any = None
    shapes: list = dataclasses.field(default_factory=list)  # probe: (Hq, Hkv, Dk, Dv) per call


@dataclass(frozen=True)
class GenericSpec:
    """What the sampler reads of a model's spec (``rlhf.models.decoder.DecoderSpec``'s fields it uses)."""

    model_type: str
    num_layers: int  # attention layers (K/V caches)
    num_heads: int
    num_kv_heads: int
    head_dim: int  # cache width: the widest K or V of any layer (narrower ones are zero-padded)
    vocab_size: int
    reason: str  # why not the fast path (the start-up line)
    arch: Any = None  # no ArchSpec: no MoE routes, no fused weights
    ep: Any = None  # no expert-parallel rollout

    def check_seq_len(self, max_seq_len: int) -> None:
        pass


def _pad(x: Tensor, d: int) -> Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _layer_attn(scaling: float | None, d: int, kw: dict) -> arch.LayerAttn:
    """The calling layer's attention settings, as transformers passes them to an attention function."""
    scale = scaling if scaling is not None else d ** -0.5
    return arch.LayerAttn(scale=float(scale), softcap=kw.get("softcap"), window=kw.get("sliding_window"), rope=0,
                          sinks=kw.get("s_aux"))


def paged_attention_forward(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query [B, H, T, Dk]``, ``key [B, Hkv, T, Dk]``,
    ``value [B, Hkv, T, Dv]`` -> ``([B, T, H, Dv], None)``; the K/V go to the paged cache of the forward
    in flight (see the module docstring); ``attention_mask`` is ignored (the builder made none)."""
    f = _CTX.get()
    if f is None:
        raise RuntimeError("rlhf_paged attention called outside a generic-path forward (rlhf.rollout.generic)")
    layer, f.layer = f.layer, f.layer + 1
    h, hkv, dk, dv = query.shape[1], key.shape[1], key.shape[-1], value.shape[-1]
    la = _layer_attn(scaling, dk, kwargs)
    if f.mode == "probe":
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise NotImplementedError(f"generic rollout: {type(module).__name__} attends bidirectionally "
                                      "(is_causal=False; an encoder's LM head needs is_decoder=True)")
        f.shapes.append((h, hkv, dk, dv))
        out = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(h // hkv, 1),
                                                               value.repeat_interleave(h // hkv, 1), is_causal=True)
        return out.transpose(1, 2), None
    cache, d, g = f.cache, f.cache.head_dim, h // hkv
    if f.mode == "decode":  # [B, H, 1, D]: one token per slot
        b = query.shape[0]
        kv = torch.cat((_pad(key, d), _pad(value, d)), dim=1)[:, :, 0]  # [B, 2Hkv, D]
        cache.write(layer, f.index, kv)
        a = cache.attend(layer, _pad(query, d)[:, :, 0].reshape(b, hkv, g, d), f.plan, la)  # [B, Hkv, G, D]
        return a[..., :dv].reshape(b, 1, h, dv), None
    if f.mode == "chunk":  # one prompt's chunk [1, H, c, D] over its cached positions
        n = query.shape[2]
        kv = torch.cat((_pad(key, d), _pad(value, d)), dim=1)  # [1, 2Hkv, c, D]
        cache.write(layer, f.index, kv.expand(f.slots.shape[0], -1, -1, -1))
        k, v = cache.view(layer, f.slots[:1], f.window)  # [1, Hkv, W, D]
        q = _pad(query, d).reshape(1, hkv, g * n, d)  # head kv * G + j -> rows j * c + i, as decoder.prefill_chunk
        a = arch.attend(q, k, v, f.masks, la)  # [1, Hkv, G * c, D]
        return a.reshape(h, n, d)[..., :dv].transpose(0, 1)[None], None
    # prefill: the packed row [1, H, Ttot, D] -> the right-padded grid [P, H, width, D] of decoder.prefill
    p, w = f.num_prompts, f.width
    qkv = torch.cat((_pad(query, d), _pad(key, d), _pad(value, d)), dim=1)[0].transpose(0, 1)  # [Ttot, Hall, D]
    if f.grid_index is not None:
        qkv = qkv.new_zeros((p * w, qkv.shape[1], d)).index_copy_(0, f.grid_index, qkv)
    grid = qkv.reshape(p, w, -1, d).transpose(1, 2)  # [P, Hall, width, D]
    if f.runs is not None:
        cache.write_runs(layer, f.runs, grid[:, h:])
    else:
        cache.write(layer, f.index, grid[:, h:].index_select(0, f.rows))
    a = arch.attend(grid[:, :h, :, :dk], grid[:, h:h + hkv, :, :dk], grid[:, h + hkv:, :, :dv], f.masks, la)
    a = a.transpose(1, 2).reshape(p * w, h, dv)
    if f.grid_index is not None:
        a = a.index_select(0, f.grid_index)
    return a[None], None


def register() -> str:
    """Register the paged attention function (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


class _Active:
    """``with _Active(f):`` makes ``f`` the forward in flight (restored after, also on errors)."""

    def __init__(self, f: _Forward) -> None:
        self.f = f

    def __enter__(self) -> _Forward:
        self.token = _CTX.set(self.f)
        return self.f

    def __exit__(self, *exc: Any) -> None:
        _CTX.reset(self.token)


# --------------------------------------------------------------------------- build / load


def build(config: Any, weights: Mapping[str, Tensor], *, device: torch.device, dtype: torch.dtype,
          consume: bool = False, reason: str = "") -> tuple[torch.nn.Module, GenericSpec]:
    """The rollout copy: ``config``'s HF causal LM on ``device`` in ``dtype``, filled with ``weights``
    (HF state-dict names, as ``rlhf.rollout.reshard`` gathers them), and its :class:`GenericSpec`
    (``reason``: why the model is not on the fast path)."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(config)
    config._attn_implementation = register()
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype)
    model.eval().requires_grad_(False)
    load(model, weights, consume=consume)
    return model, _probe(model, config, reason)


def load(model: torch.nn.Module, weights: Mapping[str, Tensor], consume: bool = False) -> None:
    """Copy ``weights`` into ``model``'s parameters and buffers in place (their addresses kept, what a
    sampler kept across steps relies on); a tied weight absent from ``weights`` keeps what it is tied to.
    ``consume``: ``weights`` is emptied on the way. Raises naming an unknown or a missing parameter."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers()))
    loaded = set()
    with torch.no_grad():
        for name in list(weights):
            dst = own.get(name)
            if dst is None:
                raise KeyError(f"generic rollout: weight {name!r} has no parameter in {type(model).__name__}")
            dst.copy_(weights[name])
            loaded.add(name)
            if consume:
                weights.pop(name)  # type: ignore[attr-defined]
    model.tie_weights()
    missing = [n for n, _ in model.named_parameters() if n not in loaded]  # a tied copy is listed once
    if missing:
        raise KeyError(f"generic rollout: no weight for {missing[0]} (and {len(missing) - 1} more)")


def _probe(model: torch.nn.Module, config: Any, reason: str) -> GenericSpec:
    """One-token forward recording each attention call's head counts and widths (the cache sizes)."""
    dev = next(model.parameters()).device
    with torch.no_grad(), _Active(_Forward("probe")) as f:
        model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=dev),
              position_ids=torch.zeros((1, 1), dtype=torch.int64, device=dev), use_cache=False)
    if not f.shapes:
        raise NotImplementedError(f"generic rollout: {config.model_type} called no attention function")
    heads = {(h, hkv) for h, hkv, _, _ in f.shapes}
    if len(heads) > 1:
        raise NotImplementedError(f"generic rollout: {config.model_type}'s attention layers differ in (query, kv) "
                                  f"heads {sorted(heads)}; the paged cache has one head count for all layers")
    layers = getattr(config, "num_hidden_layers", None) or getattr(getattr(config, "text_config", None),
                                                                   "num_hidden_layers", None)
    if layers is not None and len(f.shapes) != layers:
        raise NotImplementedError(f"generic rollout: {config.model_type}'s {layers} layers made {len(f.shapes)} "
                                  f"attention calls, not one each (layers without attention would need per-slot "
                                  f"state, and two calls per layer two caches)")
    (h, hkv), = heads
    width = max(max(dk, dv) for _, _, dk, dv in f.shapes)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return GenericSpec(model_type=config.model_type, num_layers=len(f.shapes), num_heads=h, num_kv_heads=hkv,
                       head_dim=width, vocab_size=vocab, reason=reason)


# --------------------------------------------------------------------------- forwards (decoder's signatures)


def _logits(model: torch.nn.Module, ids: Tensor, pos: Tensor, keep: Tensor | int) -> Tensor:
    out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep)
    return out.logits.float()


def prefill(spec: GenericSpec, w: torch.nn.Module, cache: Any, input_ids: Tensor, positions: Tensor,
            grid_index: Tensor | None, width: int, last_index: Tensor, slots: Tensor, rows: Tensor, cos: Any,
            sin: Any, tp_group: Any = None, embeds: Any = None, deepstack: Any = None, routes: Any = None,
            runs: list | None = None) -> Tensor:
    """``rlhf.models.decoder.prefill`` through the HF module: ``[P, V]`` float32 logits after each prompt."""
    f = _Forward("prefill", cache, grid_index=grid_index, width=width, num_prompts=last_index.shape[0],
                 index=None if runs is not None else cache.prefill_index(slots, 0, width), rows=rows, runs=runs,
                 masks=arch.Masks(None, width, input_ids.device))
    with _Active(f):
        return _logits(w, input_ids[None], positions[None], last_index)[0]


def prefill_chunk(spec: GenericSpec, w: torch.nn.Module, cache: Any, input_ids: Tensor, start: int, slots: Tensor,
                  cos: Any, sin: Any, tp_group: Any = None, embeds: Any = None, deepstack: Any = None,
                  routes: Any = None, rope_shift: int = 0) -> Tensor:
    """``rlhf.models.decoder.prefill_chunk`` through the HF module: ``[1, V]`` logits after the chunk."""
    n = input_ids.shape[0]
    positions = torch.arange(start, start + n, device=input_ids.device)
    g = spec.num_heads // spec.num_kv_heads
    f = _Forward("chunk", cache, index=cache.prefill_index(slots, start, n), slots=slots, window=start + n,
                 masks=arch.Masks(positions.repeat(g), start + n, input_ids.device))
    with _Active(f):
        return _logits(w, input_ids[None], (positions + rope_shift)[None], 1)[0]


def decode(spec: GenericSpec, w: torch.nn.Module, cache: Any, tokens: Tensor, pos: Tensor, window: int, cos: Any,
           sin: Any, tp_group: Any = None, rope_pos: Tensor | None = None, routes: Any = None) -> Tensor:
    """``rlhf.models.decoder.decode`` through the HF module: ``[B, V]`` logits of one step of slots ``[0, B)``."""
    b = tokens.shape[0]
    dtype = next(w.parameters()).dtype
    f = _Forward("decode", cache, index=cache.decode_index(pos), plan=cache.decode_plan(b, pos, window, dtype))
    rp = pos if rope_pos is None else rope_pos
    with _Active(f):
        return _logits(w, tokens[:, None], rp[:, None], 1)[:, 0]
