"""Paged key/value cache of the rollout sampler, sized by a token (memory) budget.

One buffer ``[L, NB + 1, BS, 2*Hkv, D]`` (layers, blocks of ``BS`` token positions, K heads
then V heads, head dim) allocated once (heads inside positions, so the blocks of a slot,
gathered, are one ``[B, W, 2*Hkv, D]`` tensor that attention reads through a transposed view); the last block is a scratch block that absorbs
writes to positions a sequence does not own (right padding of a prefill grid, idle slots
of the static decode shape). A slot (one live sequence) owns a list of blocks through its
row of the block table ``[S, MB]``; position ``p`` of slot ``s`` lives in block
``table[s, p // BS]`` at offset ``p % BS``.

Why paged: a slot that reserved ``max_seq_len`` positions up front would hold, for long
responses, mostly unused memory (a 20k-token limit with 3k-token typical answers leaves
85% of the cache idle). Blocks are taken as a sequence grows, so the same budget decodes
several times more sequences at once, and when it runs out the sampler preempts and
requeues a sequence instead of failing (vLLM's PagedAttention with recompute preemption,
Kwon et al. 2023).

Moving a live sequence to another slot moves its table row, not its K/V.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_BLOCK_SIZE = 16


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one cached token takes: K and V of every layer's (local) kv heads."""
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_tokens_for_memory(free_bytes: int, fraction: float, bytes_per_token: int) -> int:
    """Token budget of a cache allowed ``fraction`` of ``free_bytes`` (verl's
    ``gpu_memory_utilization`` idea, applied to the memory left after the rollout weights)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    return int(free_bytes * fraction) // bytes_per_token


class PagedKVCache:
    """Block-paged K/V buffer with a per-slot block table and a free list (host side).

    Args:
        num_blocks: blocks available to sequences (``budget_tokens // block_size``); one
            more, the scratch block, is allocated on top.
        num_slots: rows of the block table (most sequences live at once).
        max_seq_len: longest sequence a slot may grow to (columns of the table).
    """

    def __init__(self, num_layers: int, num_blocks: int, num_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, *, block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype,
                 device: torch.device) -> None:
        blocks_per_seq = -(-max_seq_len // block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"a KV cache of {num_blocks * block_size} tokens cannot hold one sequence of max_seq_len="
                f"{max_seq_len}; raise rollout.kv_cache_tokens / kv_cache_memory or lower the response length")
        # zeros, not empty: masked-out positions are still multiplied by 0 in attention and
        # uninitialised memory could hold NaN/inf.
        self.kv = torch.zeros((num_layers, num_blocks + 1, block_size, 2 * num_kv_heads, head_dim), dtype=dtype,
                              device=device)
        self.num_layers, self.num_blocks, self.num_slots = num_layers, num_blocks, num_slots
        self.num_kv_heads, self.block_size, self.head_dim = num_kv_heads, block_size, head_dim
        self.max_seq_len = max_seq_len
        self.scratch = num_blocks
        self.table = torch.full((num_slots, blocks_per_seq), self.scratch, dtype=torch.int64, device=device)
        self.owned: list[list[int]] = [[] for _ in range(num_slots)]  # host mirror of the table rows
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._heads = torch.arange(2 * num_kv_heads, device=device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ------------------------------------------------------------------ blocks

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def extra_blocks(self, slot: int, length: int) -> int:
        """Blocks slot ``slot`` still needs to hold positions ``[0, length)``."""
        return max(0, self.blocks_for(length) - len(self.owned[slot]))

    def grow(self, slots: list[int], lengths: list[int]) -> None:
        """Give each slot the blocks for positions ``[0, length)``; the caller checked ``free``."""
        rows, cols, ids = [], [], []
        for s, n in zip(slots, lengths):
            have = self.owned[s]
            for c in range(len(have), self.blocks_for(n)):
                b = self.free.pop()
                have.append(b)
                rows.append(s), cols.append(c), ids.append(b)
        if ids:
            dev = self.table.device
            self.table.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                                  torch.tensor(ids, device=dev))

    def release(self, slots: list[int]) -> None:
        """Return the slots' blocks to the free list; their table rows point at the scratch block."""
        for s in slots:
            self.free.extend(reversed(self.owned[s]))
            self.owned[s] = []
        if slots:
            self.table[torch.tensor(slots, device=self.table.device)] = self.scratch

    def detach(self, slot: int) -> list[int]:
        """Take slot ``slot``'s blocks away from it, still allocated (a parked sequence keeps them)."""
        blocks, self.owned[slot] = self.owned[slot], []
        self.table[slot] = self.scratch
        return blocks

    def attach(self, slot: int, blocks: list[int]) -> None:
        """Empty slot ``slot`` takes over ``blocks`` (from ``detach``) as its first positions."""
        self.owned[slot] = list(blocks)
        if blocks:
            self.table[slot, : len(blocks)] = torch.tensor(blocks, device=self.table.device)

    def free_blocks(self, blocks: list[int]) -> None:
        """Return detached blocks to the free list."""
        self.free.extend(reversed(blocks))

    def move(self, src: list[int], dst: list[int]) -> None:
        """Slot ``dst[i]`` takes over the blocks of slot ``src[i]`` (``dst`` slots are empty)."""
        dev = self.table.device
        s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        self.table.index_copy_(0, d, self.table.index_select(0, s))
        self.table[s] = self.scratch
        for a, b in zip(src, dst):
            self.owned[b], self.owned[a] = self.owned[a], []

    # ------------------------------------------------------------------ addressing

    def rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Rows of ``kv[layer].view(-1, D)`` holding K and V of ``positions`` ``[..., T]`` of
        ``slots`` ``[...]``: ``[..., 2Hkv, T]``. Positions a slot does not own hit the scratch block."""
        cols = (positions // self.block_size).clamp(max=self.table.shape[1] - 1)
        block = self.table[slots[..., None], cols]  # [..., T]
        h2 = 2 * self.num_kv_heads
        flat = (block * self.block_size + positions % self.block_size) * h2  # [..., T] first row of each position
        return flat[..., None, :] + self._heads[:, None]

    def prefill_index(self, slots: Tensor, start: int, length: int) -> Tensor:
        """Rows for positions ``[start, start + length)`` of ``slots`` ``[M]``: ``[M * 2Hkv * length]``
        (the order of a ``[M, 2Hkv, length, D]`` tensor); computed once per prefill, used by every layer."""
        pos = torch.arange(start, start + length, device=slots.device).expand(slots.shape[0], length)
        return self.rows(slots, pos).reshape(-1)

    def decode_index(self, pos: Tensor) -> Tensor:
        """Rows ``[B * 2Hkv]`` of position ``pos[b]`` of slot ``b``."""
        slots = torch.arange(pos.shape[0], device=pos.device)
        return self.rows(slots, pos[:, None]).reshape(-1)

    def write(self, layer: int, index: Tensor, kv: Tensor) -> None:
        """Store ``kv`` (``[M, 2Hkv, T, D]`` or ``[B, 2Hkv, D]``) at ``index`` rows."""
        self.kv[layer].view(-1, self.head_dim).index_copy_(0, index, kv.reshape(-1, self.head_dim))

    def view(self, layer: int, slots: int | Tensor, window: int) -> tuple[Tensor, Tensor]:
        """K and V of ``slots`` (a count ``B`` = slots ``[0, B)``, or ids), positions ``[0, window)``:
        ``[B, Hkv, window, D]`` each (gathered from the slots' blocks)."""
        n = -(-window // self.block_size)
        table = self.table[:slots, :n] if isinstance(slots, int) else self.table[slots, :n]
        kv = self.kv[layer][table]  # [B, n, BS, 2Hkv, D], one copy
        b, h = kv.shape[0], self.num_kv_heads
        kv = kv.view(b, n * self.block_size, 2 * h, self.head_dim)[:, :window].transpose(1, 2)  # views
        return kv[:, :h], kv[:, h:]
