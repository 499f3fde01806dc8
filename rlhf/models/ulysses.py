"""DeepSpeed-Ulysses sequence parallelism (``parallel.sp``) for padding-free passes.

The ``sp`` ranks of one group hold the *same* rows of the batch. The packed row
(:func:`rlhf.data.packing.unpad`, ``[1, total]``) is padded to a multiple of ``sp`` and
split along the tokens: rank ``r`` runs the embeddings, MLPs, norms and the LM / value
head on tokens ``[r * T/sp, (r+1) * T/sp)`` only, so every activation except attention's
inner one is ``1/sp`` of the sequence. Attention needs all tokens of a sequence; around
it an all-to-all trades the token split for a head split (each rank then holds all ``T``
tokens of ``H/sp`` heads, runs the usual varlen attention with the full ``cu_seqlens``)
and a second all-to-all trades it back (Jacobs et al. 2023, "DeepSpeed Ulysses").

Gradients. Each rank computes its tokens' per-token log-probs (or values) on its slice;
:func:`gather_token_values` sums the disjoint slices into the full ``[B, R]`` tensor
(``B * R`` scalars, never logits) and every sp rank computes the *same* loss from it.
Its backward is the identity, so rank ``r`` back-propagates ``dL/dx`` only into the tokens
it produced; the all-to-all backward carries the attention gradients to the ranks owning
the other tokens. Summed over the sp ranks, the parameter gradients are exactly
``dL/dtheta`` of the un-split model - which is why FSDP2 shards and reduces over the
flattened ``dp x sp`` mesh and ``grad_scale`` is ``dp * sp``.

GQA. The key/value heads are split over sp too; when ``num_key_value_heads`` is not a
multiple of sp, each KV head is repeated ``f`` times first (the smallest ``f`` dividing
the group size with ``Hkv * f % sp == 0``), which keeps the query -> KV head mapping.
The query heads must be divisible by sp (checked at start-up, :func:`check_sp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rlhf.data.packing import PackedBatch
from rlhf.schema.config import ConfigError

__all__ = ["SpShard", "shard_packed", "gather_token_values", "ulysses_attention", "kv_repeat_factor", "check_sp"]


def check_sp(sp: int, hf_config: Optional[Any], *, tp: int = 1, pp: int = 1, use_remove_padding: bool = True) -> None:
    """Start-up checks of ``parallel.sp`` against the model and the other features (one-line errors)."""
    if sp <= 1:
        return
    if not use_remove_padding:
        raise ConfigError(f"parallel.sp={sp}: Ulysses sequence parallelism splits the packed row; "
                          f"set model.use_remove_padding=true")
    if pp > 1:
        raise ConfigError(f"parallel.sp={sp} with parallel.pp={pp} is not supported: pipeline stages pass padded "
                          f"[B, L] activations, not packed token slices; use sp or pp")
    heads = hf_config.num_attention_heads if hf_config is not None else sp * tp
    if heads % (sp * tp):
        raise ConfigError(f"parallel.sp={sp}: the model's num_attention_heads={heads} is not divisible by "
                          f"sp x tp = {sp} x {tp}; each sp rank runs attention for heads / (tp x sp) of them")


def kv_repeat_factor(heads: int, kv_heads: int, sp: int) -> int:
    """Smallest ``f`` with ``(heads / kv_heads) % f == 0`` and ``kv_heads * f % sp == 0``."""
    group = heads // kv_heads
    for f in range(1, group + 1):
        if group % f == 0 and (kv_heads * f) % sp == 0:
            return f
    raise ValueError(f"cannot split {kv_heads} KV heads of {heads} query heads over sp={sp}")


# ---------------------------------------------------------------------- all-to-all


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[H, T/sp, D]`` (my tokens, all heads) -> ``[H/sp, T, D]`` (all tokens, my heads)."""
    sp = dist.get_world_size(group)
    H, t, D = x.shape
    send = x.reshape(sp, H // sp, t, D).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = rank j's tokens of my heads
    return recv.permute(1, 0, 2, 3).reshape(H // sp, sp * t, D)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[H/sp, T, D]`` -> ``[H, T/sp, D]``; the inverse of :func:`_seq_to_heads`."""
    sp = dist.get_world_size(group)
    h, T, D = x.shape
    send = x.reshape(h, sp, T // sp, D).permute(1, 0, 2, 3).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = my tokens of rank j's heads
    return recv.reshape(sp * h, T // sp, D)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all; the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous()
        return (_heads_to_seq(g, ctx.group) if ctx.to_heads else _seq_to_heads(g, ctx.group)), None, None


class _SumGather(torch.autograd.Function):
    """Forward: all-reduce SUM of disjoint slices. Backward: identity (see module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def gather_token_values(local: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum per-token values that each sp rank filled for its own tokens (zeros elsewhere)."""
    if group is None:
        return local
    return _SumGather.apply(local, group)


def ulysses_attention(attn_fn: Callable, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, group: dist.ProcessGroup, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Run ``attn_fn`` (varlen attention) on all tokens of ``H/sp`` heads.

    Args:
        query: ``[1, H, T/sp, D]``; key/value ``[1, Hkv, T/sp, D]`` - this rank's tokens.
        kwargs: the varlen kwargs with the *full* (padded) ``cu_seq_lens``.

    Returns:
        ``([1, T/sp, H, D], None)`` as the HF attention interface expects.
    """
    sp = dist.get_world_size(group)
    H, Hkv = query.shape[1], key.shape[1]
    f = kv_repeat_factor(H, Hkv, sp)
    if f > 1:
        key, value = key.repeat_interleave(f, dim=1), value.repeat_interleave(f, dim=1)
    q = _AllToAll.apply(query[0], group, True)[None]  # [1, H/sp, T, D]
    k = _AllToAll.apply(key[0], group, True)[None]
    v = _AllToAll.apply(value[0], group, True)[None]
    out, _ = attn_fn(module, q, k, v, attention_mask, **kwargs)  # [1, T, H/sp, D]
    out = _AllToAll.apply(out[0].transpose(0, 1).contiguous(), group, False)  # [H, T/sp, D]
    return out.transpose(0, 1)[None], None


# ---------------------------------------------------------------------- token split


@dataclass
class SpShard:
    """This rank's slice of a packed row.

    Attributes:
        input_ids, position_ids: ``[1, T/sp]`` tokens ``[start, end)`` of the padded row.
        attention_kwargs: varlen kwargs over the full padded row (pad tokens form their own
            trailing sequence, so they never mix with real ones) plus ``ulysses_group``.
        start, end: the slice in packed coordinates.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_kwargs: dict
    start: int
    end: int

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: which packed rows lie on this rank."""
        return (rows >= self.start) & (rows < self.end)


def shard_packed(packed: PackedBatch, group: dist.ProcessGroup) -> SpShard:
    """Pad the packed row to a multiple of sp and take this rank's contiguous slice."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    total = packed.total
    pad = (-total) % sp
    ids, pos, cu, max_len = packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
        max_len = max(max_len, pad)
    chunk = (total + pad) // sp
    start, end = rank * chunk, (rank + 1) * chunk
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len,
              "ulysses_group": group}
    return SpShard(input_ids=ids[:, start:end], position_ids=pos[:, start:end], attention_kwargs=kwargs,
                   start=start, end=end)
