"""Preallocated (static) key/value cache of the rollout sampler.

One contiguous buffer ``[L, S, 2*Hkv, T, D]`` (layers, slots, K heads then V heads, max
sequence length, head dim) allocated once. Keeping K and V of a token next to each other
along the head axis lets one ``index_copy_`` per layer store both. A slot holds one
sequence (prompt + response). Nothing is concatenated or reallocated while generating.
Slots are addressed by index, so the scheduler can keep the live sequences in a prefix
``[0, B)`` of the slots and run decode on contiguous views.
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


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one cached token takes: K and V of every layer's (local) kv heads."""
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_tokens_for_memory(free_bytes: int, fraction: float, bytes_per_token: int) -> int:
    """Token budget of a cache allowed ``fraction`` of ``free_bytes`` (verl's
    ``gpu_memory_utilization`` idea, applied to the memory left after the rollout weights)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    return int(free_bytes * fraction) // bytes_per_token


class StaticKVCache:
    """K/V buffer ``[L, S, 2*Hkv, T, D]`` with slot-indexed writes and views."""

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
        # zeros, not empty: masked-out positions are still multiplied by 0 in attention and
        # uninitialised memory could hold NaN/inf.
        self.kv = torch.zeros((num_layers, num_slots, 2 * num_kv_heads, max_seq_len, head_dim), dtype=dtype, device=device)
        self.num_layers, self.num_slots, self.num_kv_heads = num_layers, num_slots, num_kv_heads
        self.max_seq_len, self.head_dim = max_seq_len, head_dim
        # row offset of (slot, head) in a layer viewed as [S * 2Hkv * T, D]: decode adds pos
        heads = torch.arange(num_slots * 2 * num_kv_heads, device=device).view(num_slots, 2 * num_kv_heads)
        self._row_base = heads * max_seq_len  # [S, 2Hkv]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write_prefill(self, layer: int, slots: Tensor, kv: Tensor) -> None:
        """Store prompt K|V ``[M, 2Hkv, Tp, D]`` in ``slots`` ``[M]`` at positions ``[0, Tp)``."""
        self.kv[layer, :, :, : kv.shape[2]].index_copy_(0, slots, kv)

    def decode_index(self, pos: Tensor) -> Tensor:
        """Rows ``[B * 2Hkv]`` of position ``pos[b]`` of slot ``b`` (every K and V head) in a
        layer viewed as ``[S*2Hkv*T, D]``; computed once per step, reused by every layer."""
        return (self._row_base[: pos.shape[0]] + pos[:, None]).view(-1)

    def write_decode(self, layer: int, index: Tensor, kv: Tensor) -> None:
        """Store one token per slot: ``kv`` ``[B, 2Hkv, D]`` at rows ``index`` from ``decode_index``."""
        self.kv[layer].view(-1, self.head_dim).index_copy_(0, index, kv.reshape(-1, self.head_dim))

    def view(self, layer: int, batch: int, window: int) -> tuple[Tensor, Tensor]:
        """K and V of slots ``[0, batch)``, positions ``[0, window)``: ``[batch, Hkv, window, D]`` views."""
        h = self.num_kv_heads
        return self.kv[layer, :batch, :h, :window], self.kv[layer, :batch, h:, :window]

    def move(self, src: list[int], dst: list[int], upto: int) -> None:
        """Copy positions ``[0, upto)`` of slots ``src`` into slots ``dst`` (all layers).

        One strided copy per pair: gathering with ``index_select`` over the slot axis of the
        non-contiguous ``[..., :upto, :]`` view is orders of magnitude slower on CPU.
        """
        for s, d in zip(src, dst):
            self.kv[:, d, :, :upto].copy_(self.kv[:, s, :, :upto])
