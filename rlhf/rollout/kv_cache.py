"""Preallocated (static) key/value cache of the rollout sampler.

One contiguous buffer per K and V of shape ``[L, S, Hkv, T, D]`` (layers, slots, kv heads,
max sequence length, head dim) allocated once. A slot holds one sequence (prompt +
response). Writes are ``index_copy_`` into the buffer; nothing is concatenated or
reallocated while generating. Slots are addressed by index, so the scheduler can keep the
live sequences in a prefix ``[0, B)`` of the slots and run decode on a contiguous view.
"""

from __future__ import annotations

import torch
from torch import Tensor


def num_slots_for(max_num_seqs: int, max_seq_len: int, kv_cache_tokens: int | None) -> int:
    """Number of sequence slots that fit the token budget (default: ``max_num_seqs`` slots)."""
    if kv_cache_tokens is None:
        return max_num_seqs
    slots = min(max_num_seqs, kv_cache_tokens // max_seq_len)
    if slots < 1:
        raise ValueError(
            f"kv_cache_tokens={kv_cache_tokens} cannot hold one sequence of max_seq_len={max_seq_len}; "
            "raise kv_cache_tokens or lower max_seq_len / max_new_tokens"
        )
    return slots


class StaticKVCache:
    """K/V buffers ``[L, S, Hkv, T, D]`` with slot-indexed writes and views."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        # zeros, not empty: masked-out positions are still multiplied by 0 in attention and
        # uninitialised memory could hold NaN/inf.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.num_slots, self.num_kv_heads, self.max_seq_len, self.head_dim = shape

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write_prefill(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store prompt K/V: ``k, v`` ``[M, Hkv, Tp, D]`` go to ``slots`` ``[M]`` positions ``[0, Tp)``."""
        tp = k.shape[2]
        self.k[layer, :, :, :tp].index_copy_(0, slots, k)
        self.v[layer, :, :, :tp].index_copy_(0, slots, v)

    def decode_index(self, pos: Tensor) -> Tensor:
        """Flat row indices ``[B * Hkv]`` of position ``pos[b]`` in slot ``b`` for every kv head.

        Row ``((b * Hkv + h) * T + pos[b])`` of the layer buffer viewed as ``[S*Hkv*T, D]``;
        computed once per decode step and reused by every layer.
        """
        b = torch.arange(pos.shape[0], device=pos.device)
        h = torch.arange(self.num_kv_heads, device=pos.device)
        return ((b[:, None] * self.num_kv_heads + h[None, :]) * self.max_seq_len + pos[:, None]).reshape(-1)

    def write_decode(self, layer: int, index: Tensor, k: Tensor, v: Tensor) -> None:
        """Store one new token per slot: ``k, v`` ``[B, Hkv, D]`` at rows ``index`` from ``decode_index``."""
        d = self.head_dim
        self.k[layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v.reshape(-1, d))

    def view(self, layer: int, batch: int, window: int) -> tuple[Tensor, Tensor]:
        """K and V of slots ``[0, batch)`` and positions ``[0, window)``: ``[batch, Hkv, window, D]`` views."""
        return self.k[layer, :batch, :, :window], self.v[layer, :batch, :, :window]

    def move(self, src: Tensor, dst: Tensor, upto: int) -> None:
        """Copy positions ``[0, upto)`` of slots ``src`` ``[M]`` into slots ``dst`` ``[M]`` (all layers)."""
        for buf in (self.k, self.v):
            part = buf[:, :, :, :upto]
            part.index_copy_(1, dst, part.index_select(1, src))
