"""Padding-free forward passes for the actor, the reference and the critic.

Same contract as the padded ``rlhf.models.logprobs.forward_log_probs``: for a batch
``input_ids [B, L]`` = left-padded prompt (``P = L - R``) + right-padded response (``R``),

    log_probs[b, t] = log_softmax(logits[b, P+t-1] / temperature)[input_ids[b, P+t]]

with ``position_ids = cumsum(attention_mask) - 1``. Here the real tokens are packed into
one row (:func:`rlhf.data.packing.unpad`), attention runs per sequence
(:mod:`rlhf.models.varlen_attention`) and the vocabulary projection is applied only to
the positions that predict a real response token (``logits_to_keep`` with an index
tensor), so neither pad tokens nor prompt tokens ever reach the ``[*, V]`` logits.
Entries for pad response tokens are 0 (the caller masks them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rlhf.data.packing import PackedBatch, unpad
from rlhf.models.prefix_grouping import GroupedRow, group_by_prompt, shared_prompt_tokens, should_group
from rlhf.models.ulysses import SpShard, gather_token_values, shard_packed
from rlhf.models.varlen_attention import build_varlen_plan, enable_varlen_attention, varlen_kernel
from rlhf.models.vocab_parallel import log_probs_from_logits

__all__ = [
    "ResponsePositions",
    "response_positions",
    "packed_forward_log_probs",
    "packed_forward_hidden",
]


@dataclass
class ResponsePositions:
    """Where the response predictions sit in the packed row.

    Attributes:
        rows: ``[N]`` packed index of the position ``P+t-1`` for every kept ``(b, t)``.
        flat: ``[N]`` index ``b * R + t`` into the flattened ``[B, R]`` output.
        labels: ``[N]`` the token ``input_ids[b, P+t]`` predicted there.
    """

    rows: torch.Tensor
    flat: torch.Tensor
    labels: torch.Tensor


def response_positions(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: Optional[PackedBatch], response_length: int,
    inverse: Optional[torch.Tensor] = None,
) -> ResponsePositions:
    """Map response tokens ``(b, t)`` to the packed positions whose output predicts them.

    A pair is kept when the response token ``P+t`` is real and the position before it,
    ``P+t-1``, is real too (true for every real response token of a rollout batch).
    ``inverse`` ``[B*L]`` (packed row of each padded position, -1 at pads) replaces ``packed``
    for other packed layouts (a prefix-grouped row: :mod:`rlhf.models.prefix_grouping`).
    """
    B, L = input_ids.shape
    R = int(response_length)
    if not 0 < R < L:
        raise ValueError(f"response_length must be in [1, L-1] = [1, {L - 1}] (a prompt token is needed); got {R}")
    P = L - R
    device = input_ids.device
    if inverse is None:
        inverse = torch.full((B * L,), -1, dtype=torch.int64, device=device)
        inverse[packed.indices] = torch.arange(packed.total, device=device)
    src = torch.arange(B, device=device)[:, None] * L + (P - 1) + torch.arange(R, device=device)[None, :]  # [B, R]
    rows = inverse[src]  # [B, R]
    keep = (rows >= 0) & attention_mask[:, P:].bool()  # [B, R]
    flat = torch.nonzero(keep.flatten(), as_tuple=False).flatten()  # [N]
    return ResponsePositions(rows=rows.flatten()[flat], flat=flat, labels=input_ids[:, P:].flatten()[flat])


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return "logits_to_keep" in inspect.signature(m.forward).parameters
    return False


def _packed_call(model: nn.Module, packed: PackedBatch | GroupedRow, shard: Optional[SpShard] = None,
                 **extra) -> object:
    """Run ``model`` on a packed row (or, under ``parallel.sp``, on this rank's ``shard`` of it)
    through its own top-level ``forward`` (so FSDP2 root hooks and peft wrappers run as usual).

    The model is switched to varlen attention for good (it behaves as sdpa for padded
    calls): an activation-checkpointed backward recomputes blocks after this returns.
    """
    if shard is None:
        ids, pos, kwargs = packed.input_ids, packed.position_ids, dict(packed.attention_kwargs())
    else:
        ids, pos, kwargs = shard.input_ids, shard.position_ids, dict(shard.attention_kwargs)
    # The SDPA fallback needs a plan; build it once per forward, not once per layer (each
    # build reads cu_seqlens on the host: a device sync per layer on a GPU without flash-attn).
    if "cu_seq_lens_q" in kwargs and varlen_kernel(ids.device) is None:
        kwargs["varlen_plan"] = build_varlen_plan(kwargs["cu_seq_lens_q"])
    enable_varlen_attention(model)
    if "position_ids" in extra:  # a vision-language model's [4, 1, total] M-RoPE positions
        if shard is not None:
            raise NotImplementedError("parallel.sp with a vision-language model is not supported")
        pos = extra.pop("position_ids")
    return model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs, **extra)


def _local_positions(pos: ResponsePositions, shard: Optional[SpShard]) -> ResponsePositions:
    """The response positions computed on this sp rank, in its slice's coordinates."""
    if shard is None:
        return pos
    keep = shard.local_rows(pos.rows)
    return ResponsePositions(rows=pos.rows[keep] - shard.start, flat=pos.flat[keep], labels=pos.labels[keep])


def _layout(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, R: int, prefix_grouping, sp_group, multi_modal):
    """(packed row, response positions, sp shard) of a padded batch: the prefix-grouped row when grouping
    applies, else the plain unpadded row (sharded over ``sp_group``)."""
    packed, pos = _grouped_row(model, input_ids, attention_mask, R, prefix_grouping, sp_group, multi_modal)
    if packed is not None:
        return packed, pos, None
    packed = unpad(input_ids, attention_mask)
    shard = shard_packed(packed, sp_group) if sp_group is not None else None
    return packed, _local_positions(response_positions(input_ids, attention_mask, packed, R), shard), shard


def _hidden_size(model: nn.Module) -> int:
    """The model's hidden size from its HF config (through FSDP / peft wrappers, which forward attributes);
    0 when it has none (``auto`` then keeps grouping off on an accelerator without a varlen kernel)."""
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "hidden_size", None) or getattr(getattr(cfg, "text_config", None), "hidden_size", 0) or 0)


def _grouped_row(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, R: int,
                 mode: bool | str, sp_group: Optional[dist.ProcessGroup], multi_modal: Optional[dict],
                 ) -> tuple[Optional[GroupedRow], Optional[ResponsePositions]]:
    """The prefix-grouped row and its response positions when ``mode`` asks for it (and, under
    ``"auto"``, when it pays); ``(None, None)`` for the plain packed row."""
    if mode is False or mode == "false" or sp_group is not None or multi_modal is not None:
        if mode is True and (sp_group is not None or multi_modal is not None):
            raise NotImplementedError("model.prefix_grouping: not supported with parallel.sp > 1 or a vision-language "
                                      "model; set model.prefix_grouping=false")
        return None, None
    dev = input_ids.device
    if mode == "auto" and not should_group(mode, shared_prompt_tokens(input_ids, attention_mask, R),
                                           int(attention_mask.sum()), device_type=dev.type,
                                           varlen_kernel=varlen_kernel(dev) is not None,
                                           hidden_size=_hidden_size(model)):
        return None, None
    row = group_by_prompt(input_ids, attention_mask, R)
    return row, response_positions(input_ids, attention_mask, None, R, inverse=row.inverse)


def packed_forward_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_length: int,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    sp_group: Optional[dist.ProcessGroup] = None,
    multi_modal: Optional[dict] = None,
    prefix_grouping: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the response, padding-free.

    Args:
        model: an HF causal LM (optionally peft-wrapped / FSDP2-sharded).
        input_ids: ``[B, L]`` left-padded prompt + right-padded response.
        attention_mask: ``[B, L]``.
        response_length: ``R``; the response occupies the last ``R`` columns.
        temperature: logits are divided by it before the softmax (the sampler's value).
        compute_entropy: also return the entropy of ``softmax(logits / temperature)``.
        sp_group: Ulysses sequence-parallel group (:mod:`rlhf.models.ulysses`): this rank
            runs its slice of the packed row and the per-token results are summed over sp.
        multi_modal: a vision-language model's images of these rows
            (:func:`rlhf.data.multimodal.collate_multi_modal`): the vision tower runs on them and
            the packed row gets M-RoPE positions (:func:`rlhf.models.vlm.packed_inputs`).
        prefix_grouping: True / False / ``"auto"`` (``model.prefix_grouping``): rows sharing a prompt
            forward it once (:mod:`rlhf.models.prefix_grouping`; not with ``sp_group`` / ``multi_modal``).

    Returns:
        ``log_probs [B, R]`` float32 and ``entropy [B, R]`` float32 (or None); 0 at pad
        response tokens. Differentiable with respect to the model parameters.
    """
    B, L = input_ids.shape
    R = int(response_length)
    packed, pos, shard = _layout(model, input_ids, attention_mask, R, prefix_grouping, sp_group, multi_modal)
    mm: dict = {}
    if multi_modal is not None:
        from rlhf.models.vlm import packed_inputs

        mm = packed_inputs(model, input_ids, attention_mask, multi_modal, packed.indices, packed.position_ids)
    if _accepts_logits_to_keep(model):
        out = _packed_call(model, packed, shard, logits_to_keep=pos.rows, **mm)
        logits = out.logits  # [1, N, V], or under TP its vocab shard (a DTensor, never gathered)
    else:
        out = _packed_call(model, packed, shard, **mm)
        logits = out.logits[:, pos.rows]  # [1, N, V]
    # fp32 inside: bf16 log-probs are too coarse for PPO ratios.
    lp, ent = log_probs_from_logits(logits, pos.labels[None], temperature=temperature,
                                    compute_entropy=compute_entropy)  # [1, N] each
    log_probs = gather_token_values(lp.new_zeros(B * R).index_put((pos.flat,), lp[0]), sp_group).view(B, R)
    entropy = None
    if compute_entropy:
        entropy = gather_token_values(ent.new_zeros(B * R).index_put((pos.flat,), ent[0]), sp_group).view(B, R)
    return log_probs, entropy


def packed_forward_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_length: int,
) -> torch.Tensor:
    """Last hidden states (after the final norm) at the positions predicting the response.

    For a critic, ``values[b, t] = head(hidden[b, t])`` is the value of the state before
    response token ``t`` — verl's ``values = output[:, -R-1:-1]`` convention.

    Args:
        model: an HF backbone (``*Model``) or a model with an LM / token head; for a
            causal LM no logits are computed beyond one position.
        input_ids, attention_mask: ``[B, L]`` as in :func:`packed_forward_log_probs`.
        response_length: ``R``.

    Returns:
        ``[B, R, H]`` in the model's dtype; zeros at pad response tokens.
    """
    B, L = input_ids.shape
    R = int(response_length)
    packed = unpad(input_ids, attention_mask)
    pos = response_positions(input_ids, attention_mask, packed, R)
    extra: dict = {"output_hidden_states": True}
    if _accepts_logits_to_keep(model):
        extra["logits_to_keep"] = 1  # the hidden states are what we want; skip the [total, V] logits
    out = _packed_call(model, packed, **extra)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out.hidden_states[-1]
    hidden = hidden[0].index_select(0, pos.rows)  # [N, H]
    full = hidden.new_zeros(B * R, hidden.shape[-1]).index_put((pos.flat,), hidden)
    return full.view(B, R, -1)


def packed_forward_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                          response_length: int, sp_group: Optional[dist.ProcessGroup] = None,
                          prefix_grouping: bool | str = False) -> torch.Tensor:
    """Padding-free values ``[B, R]`` (fp32) of a token-classification critic; 0 at pad response tokens.

    The real tokens are packed into one row (:func:`rlhf.data.packing.unpad`, varlen
    attention per sequence) and run through the model's own forward (FSDP2 hooks run as
    usual); the ``[1, total, 1]`` head output is read at the packed positions ``P + t - 1``
    that precede each real response token ``t`` (:func:`rlhf.models.packed.response_positions`),
    the positions of the padded path's ``logits[:, -R-1:-1]``. The head is ``H -> 1``, so
    applying it to every packed token costs nothing worth avoiding. With ``sp_group`` each
    sp rank reads the values of its token slice and the ``[B, R]`` scalars are summed.
    """
    B, R = input_ids.shape[0], int(response_length)
    packed, pos, shard = _layout(model, input_ids, attention_mask, R, prefix_grouping, sp_group, None)
    out = _packed_call(model, packed, shard)
    v = out.logits[0, :, 0].index_select(0, pos.rows).float()  # [N]
    return gather_token_values(v.new_zeros(B * R).index_put((pos.flat,), v), sp_group).view(B, R)
