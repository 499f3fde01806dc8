"""Paged key/value cache of the rollout sampler, sized by a token (memory) budget.

One buffer ``[L, 2*Hkv, NB + 1, BS, D]`` (layers, K heads then V heads, blocks of ``BS``
token positions, head dim) allocated once. Heads are outside the blocks so that the blocks
of a slot, gathered along the block axis, are one contiguous ``[W, D]`` window per head
(what SDPA reads fastest), and a head's blocks viewed as ``[NB + 1, BS, D]`` are flash-attn's
paged layout. The last block is a scratch block that absorbs writes to positions a sequence
does not own (right padding of a prefill grid, idle slots of the static decode shape). A slot
(one live sequence) owns a list of blocks through its row of the block table ``[S, MB]``;
position ``p`` of slot ``s`` lives in block ``table[s, p // BS]`` at offset ``p % BS``.

Why paged: a slot that reserved ``max_seq_len`` positions up front would hold, for long
responses, mostly unused memory (a 20k-token limit with 3k-token typical answers leaves
85% of the cache idle). Blocks are taken as a sequence grows, so the same budget decodes
several times more sequences at once, and when it runs out the sampler preempts and
requeues a sequence instead of failing (vLLM's PagedAttention with recompute preemption,
Kwon et al. 2023). The samples of a prompt share its full blocks (ref-counted).

When the budget holds every slot at ``max_seq_len`` there is nothing to save, and decode
speed wins: the contiguous mode reads each layer's buffer as fixed slot regions
``[2, S, Hkv, T, D]`` (K of every slot, then V; ``T = MB * BS``), so that attention reads the
live slots' K/V in place as ``[B * Hkv, W, D]`` batches of one stride (one batched matmul,
no gather; a slot's heads are neighbours in memory) (see ``PagedKVCache``). Decode attention
reads the cache through a kernel (``rlhf.rollout.paged_attention``).

Aligned contiguous mode (``start(prefix_cols=Pm)``, GRPO calls: ``rlhf.rollout.region_cascade``):
slot ``s`` keeps position ``p`` at column ``p + shift[s]`` of its region, ``shift = Pm - prompt
length``, so every prompt ends at column ``Pm`` and every response starts there; columns
``[0, shift)`` are masked. Then the samples of a prompt hold the same prefix columns and their
responses the same columns, which is what lets decode read a group's prompt once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf.rollout.paged_attention import GatherAttention

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
    """Block-paged K/V buffer with a per-slot block table, ref-counted blocks and a free list.

    Two ways of handing out blocks, chosen per ``generate`` call by ``start``:

    * paged: blocks come from the free list as sequences grow; the full blocks of a prompt
      can be shared by its samples (``share``, ref-counted: a block returns to the free list
      when its last holder releases it); moving a sequence to another slot moves its table row.
    * contiguous (``start(contiguous=True)``, only when every slot fits at ``max_seq_len``):
      the buffer of a layer is read as slot regions ``[2, S, Hkv, T, D]`` instead of blocks
      (``regions``; the block table is not used), so the K/V of slots ``[0, B)`` are views
      and decode attention reads them without a gather; moving a sequence copies its K/V
      (compaction, once per finished sequence) instead.

    Args:
        num_blocks: blocks available to sequences (``budget_tokens // block_size``); one
            more, the scratch block, is allocated on top.
        num_slots: rows of the block table (most sequences live at once).
        max_seq_len: longest sequence a slot may grow to (columns of the table).
        attention: the decode attention kernel (``rlhf.rollout.paged_attention``).
    """

    def __init__(self, num_layers: int, num_blocks: int, num_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, *, block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype,
                 device: torch.device, attention: Any = None) -> None:
        blocks_per_seq = -(-max_seq_len // block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"a KV cache of {num_blocks * block_size} tokens cannot hold one sequence of max_seq_len="
                f"{max_seq_len}; raise rollout.kv_cache_tokens / kv_cache_memory or lower the response length")
        # zeros, not empty: masked-out positions are still multiplied by 0 in attention and
        # uninitialised memory could hold NaN/inf.
        self.kv = torch.zeros((num_layers, 2 * num_kv_heads, num_blocks + 1, block_size, head_dim), dtype=dtype,
                              device=device)
        self.num_layers, self.num_blocks, self.num_slots = num_layers, num_blocks, num_slots
        self.num_kv_heads, self.block_size, self.head_dim = num_kv_heads, block_size, head_dim
        self.max_seq_len, self.blocks_per_seq = max_seq_len, blocks_per_seq
        self.scratch = num_blocks
        self._rows_of = [self.kv[i].view(-1, head_dim) for i in range(num_layers)]  # a layer's K/V rows
        self.table = torch.full((num_slots, blocks_per_seq), self.scratch, dtype=torch.int64, device=device)
        self.owned: list[list[int]] = [[] for _ in range(num_slots)]  # host mirror of the table rows
        self.refs = [0] * num_blocks  # holders of each block (slots and parked sequences)
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.contiguous = False
        self._regions: Tensor | None = None
        self._used = 0  # blocks held (contiguous mode)
        self._head_rows = torch.arange(2 * num_kv_heads, device=device) * ((num_blocks + 1) * block_size)
        # contiguous mode: row of (slot 0, K/V head j, position 0) in a layer's buffer read as regions
        t, j = blocks_per_seq * block_size, torch.arange(2 * num_kv_heads, device=device)
        self._region_rows = ((j // num_kv_heads) * num_slots * num_kv_heads + j % num_kv_heads) * t
        self.attention = attention or GatherAttention()
        self._window = torch.empty(0, dtype=dtype, device=device)  # gather buffer, reused on CPU
        # aligned contiguous mode (module docstring): column of position p = p + shift[slot]; group:
        # the prefill unit (prompt and admission) of each slot; version: bumped whenever slots change
        self.prefix_cols = 0
        self.shift = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.shift_host = [0] * num_slots
        self.group = [-1] * num_slots
        self.version = 0
        self.step_column: int | None = None  # aligned mode: the one column every live slot writes this step

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def fits_every_slot(self) -> bool:
        return self.num_blocks >= self.num_slots * self.blocks_per_seq

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._used if self.contiguous else len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def start(self, contiguous: bool, prefix_cols: int = 0) -> None:
        """Begin a ``generate`` call (every block free) in paged or contiguous mode (see class doc);
        ``prefix_cols`` > 0: the aligned contiguous mode (module docstring), prompts of at most that length."""
        if self.num_free != self.num_blocks:
            raise RuntimeError("PagedKVCache.start: blocks of an earlier call are still held")
        self.contiguous = contiguous and self.fits_every_slot
        self.prefix_cols = prefix_cols if self.contiguous else 0
        self.shift.zero_()
        self.shift_host = [0] * self.num_slots
        self.group = [-1] * self.num_slots
        self.version += 1
        self.step_column = None
        self.table.fill_(self.scratch)  # (contiguous mode addresses slot regions, not the table)
        self._regions = self._region_view() if self.contiguous else None

    _units = 0  # prefill units handed out in this process (new_units)

    @staticmethod
    def new_units(k: int) -> int:
        """The first of ``k`` fresh prefill-unit ids, unique in the process: the aligned mode's groups, by
        which a decode kernel may keep a group's prompt K/V across steps and compactions."""
        first = PagedKVCache._units
        PagedKVCache._units += k
        return first

    def align(self, slots: list[int], prompt_lens: list[int], groups: list[int]) -> None:
        """Aligned mode: slots ``slots`` start prompts of ``prompt_lens`` tokens (before their prefill),
        prefilled as units ``groups`` (slots of one unit hold identical prompt K/V). A prompt longer than
        ``prefix_cols`` keeps positions as columns and no group (its response starts later)."""
        if not self.prefix_cols or not slots:
            return
        shifts = [max(0, self.prefix_cols - n) for n in prompt_lens]
        for s, sh, g, n in zip(slots, shifts, groups, prompt_lens):
            self.shift_host[s], self.group[s] = sh, (g if n <= self.prefix_cols else -1)
        dev = self.shift.device
        self.shift[torch.tensor(slots, device=dev)] = torch.tensor(shifts, dtype=torch.int64, device=dev)
        self.version += 1

    # ------------------------------------------------------------------ blocks

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def extra_blocks(self, slot: int, length: int) -> int:
        """Blocks slot ``slot`` still needs to hold positions ``[0, length)``."""
        return max(0, self.blocks_for(length) - len(self.owned[slot]))

    def grow(self, slots: list[int], lengths: list[int]) -> None:
        """Give each slot the blocks for positions ``[0, length)``; the caller checked ``num_free``."""
        rows, cols, ids = [], [], []
        for s, n in zip(slots, lengths):
            have = self.owned[s]
            for c in range(len(have), self.blocks_for(n)):
                if self.contiguous:
                    have.append(s * self.blocks_per_seq + c)
                    self._used += 1
                    continue
                b = self.free.pop()
                self.refs[b] = 1
                have.append(b)
                rows.append(s), cols.append(c), ids.append(b)
        if ids:
            dev = self.table.device
            self.table.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                                  torch.tensor(ids, device=dev))

    def share(self, src: int, dst: list[int], count: int) -> None:
        """Empty slots ``dst`` take the first ``count`` blocks of slot ``src`` as theirs too
        (paged mode; the blocks must never be written again: full blocks of a prompt)."""
        blocks = self.owned[src][:count]
        if not dst or not blocks:
            return
        for d in dst:
            self.owned[d] = list(blocks)
        for b in blocks:
            self.refs[b] += len(dst)
        dev = self.table.device
        self.table[torch.tensor(dst, device=dev)[:, None], torch.arange(count, device=dev)] = \
            torch.tensor(blocks, device=dev)

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one hold on each block (a released slot's or a parked sequence's); blocks nobody
        holds any more return to the free list."""
        if self.contiguous:
            self._used -= len(blocks)
            return
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def release(self, slots: list[int]) -> None:
        """Free the slots' blocks (``free_blocks``); in paged mode their table rows point at the scratch block."""
        for s in slots:
            self.free_blocks(self.owned[s])
            self.owned[s] = []
        if slots and not self.contiguous:
            self.table[torch.tensor(slots, device=self.table.device)] = self.scratch

    def detach(self, slot: int) -> list[int]:
        """Take slot ``slot``'s blocks away from it, still held (a parked sequence keeps them; paged mode)."""
        assert not self.contiguous, "parking needs the paged mode"
        blocks, self.owned[slot] = self.owned[slot], []
        self.table[slot] = self.scratch
        return blocks

    def attach(self, slot: int, blocks: list[int]) -> None:
        """Empty slot ``slot`` takes over ``blocks`` (from ``detach``) as its first positions."""
        self.owned[slot] = list(blocks)
        if blocks:
            self.table[slot, : len(blocks)] = torch.tensor(blocks, device=self.table.device)

    def move(self, src: list[int], dst: list[int]) -> None:
        """Slot ``dst[i]`` takes over the sequence of slot ``src[i]`` (``dst`` slots are empty)."""
        dev = self.table.device
        if self.contiguous:  # copy the K/V the sequence holds between the slots' regions, all layers at once
            mb, regions = self.blocks_per_seq, self.regions()
            for a, b in zip(src, dst):
                n = len(self.owned[a])
                cols = self.shift_host[a] + n * self.block_size  # aligned mode: the slot's columns end later
                regions[:, :, b, :, :cols].copy_(regions[:, :, a, :, :cols])
                self.owned[b] = [b * mb + c for c in range(n)]
                self.owned[a] = []
                self.shift_host[b], self.group[b], self.group[a] = self.shift_host[a], self.group[a], -1
            if self.prefix_cols:
                s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
                self.shift.index_copy_(0, d, self.shift.index_select(0, s))
                self.version += 1
            return
        s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        self.table.index_copy_(0, d, self.table.index_select(0, s))
        self.table[s] = self.scratch
        for a, b in zip(src, dst):
            self.owned[b], self.owned[a] = self.owned[a], []

    # ------------------------------------------------------------------ addressing

    def regions(self) -> Tensor:
        """Every layer's buffer read as slot regions, ``[L, 2, S, Hkv, T, D]`` views (contiguous mode):
        slot ``s`` keeps K (``[:, 0]``) and V (``[:, 1]``) of its positions ``[0, T)`` there."""
        assert self._regions is not None, "slot regions exist in contiguous mode only"
        return self._regions

    def _region_view(self) -> Tensor:
        mb, h, d = self.blocks_per_seq, self.num_kv_heads, self.head_dim
        size = 2 * self.num_slots * h * mb * self.block_size * d  # <= a layer's buffer when every slot fits
        return self.kv.view(self.num_layers, -1)[:, :size].view(self.num_layers, 2, self.num_slots, h, -1, d)

    def rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Rows of ``kv[layer].view(-1, D)`` holding K and V of ``positions`` ``[..., T]`` of
        ``slots`` ``[...]``: ``[..., 2Hkv, T]``. Positions a slot does not own hit the scratch block
        (paged mode) or its own region (contiguous mode)."""
        if self.contiguous:
            t = self.blocks_per_seq * self.block_size
            if self.prefix_cols:  # aligned mode: position p of slot s at column p + shift[s]
                positions = positions + self.shift[slots][..., None]
            flat = slots[..., None] * (self.num_kv_heads * t) + positions.clamp(max=t - 1)  # [..., T]
            return flat[..., None, :] + self._region_rows[:, None]
        cols = (positions // self.block_size).clamp(max=self.table.shape[1] - 1)
        block = self.table[slots[..., None], cols]  # [..., T]
        flat = block * self.block_size + positions % self.block_size  # [..., T] row of each position in head 0
        return flat[..., None, :] + self._head_rows[:, None]

    def prefill_index(self, slots: Tensor, start: int, length: int) -> Tensor:
        """Rows for positions ``[start, start + length)`` of ``slots`` ``[M]``: ``[M * 2Hkv * length]``
        (the order of a ``[M, 2Hkv, length, D]`` tensor); computed once per prefill, used by every layer."""
        pos = torch.arange(start, start + length, device=slots.device).expand(slots.shape[0], length)
        return self.rows(slots, pos).reshape(-1)

    def prefill_runs(self, slots: list[int], rows: list[int], width: int) -> list[tuple[int, int, int, int]] | None:
        """Contiguous mode: a prefill's ``slots`` (taking prompt ``rows`` of a ``width``-column grid; host
        lists: no device read) as runs ``(prompt row, first slot, slots, first column)`` of consecutive slots that take one
        prompt at one column shift (``write_runs``). None in paged mode or where a prompt's columns would
        pass the end of a region (``rows`` clamps those)."""
        if not self.contiguous:
            return None
        t = self.blocks_per_seq * self.block_size
        runs: list[list[int]] = []
        for s, r in zip(slots, rows):
            sh = self.shift_host[s] if self.prefix_cols else 0
            if sh + width > t:
                return None
            last = runs[-1] if runs else None
            if last is not None and last[0] == r and last[1] + last[2] == s and last[3] == sh:
                last[2] += 1
            else:
                runs.append([r, s, 1, sh])
        return [(r, s, c, sh) for r, s, c, sh in runs]

    def write_runs(self, layer: int, runs: list[tuple[int, int, int, int]], kv: Tensor) -> None:
        """Store the prompts' K/V ``kv`` ``[P, 2Hkv, width, D]`` into the slots of ``prefill_runs``' runs: one
        broadcast copy per run into its slot regions, instead of a per-slot replica of the prompt's K/V
        (``index_select``) scattered row by row (``index_copy_``), which cost ~2x at GRPO sizes."""
        p, _, w, d = kv.shape
        src, regions = kv.view(p, 2, self.num_kv_heads, w, d), self.regions()[layer]
        for r, s, c, sh in runs:
            regions[:, s:s + c, :, sh:sh + w].copy_(src[r][:, None])

    def decode_index(self, pos: Tensor) -> Tensor | int:
        """Rows ``[B * 2Hkv]`` of position ``pos[b]`` of slot ``b``; in the aligned mode, when every slot
        writes one column (``step_column``), that column (``write`` then copies into a strided view)."""
        if self.prefix_cols and self.step_column is not None:
            return self.step_column
        slots = torch.arange(pos.shape[0], device=pos.device)
        return self.rows(slots, pos[:, None]).reshape(-1)

    def write(self, layer: int, index: Tensor, kv: Tensor) -> None:
        """Store ``kv`` (``[M, 2Hkv, T, D]`` or ``[B, 2Hkv, D]``) at ``index`` rows (an int: that column
        of slots ``[0, B)``, the aligned mode's ``decode_index``)."""
        if isinstance(index, int):
            b, h = kv.shape[0], self.num_kv_heads
            self.regions()[layer, :, :b, :, index].copy_(kv.view(b, 2, h, self.head_dim).transpose(0, 1))
            return
        self._rows_of[layer].index_copy_(0, index, kv.reshape(-1, self.head_dim))

    def view(self, layer: int, slots: Tensor, window: int) -> tuple[Tensor, Tensor]:
        """K and V of slots ``slots`` ``[B]``, positions ``[0, window)``: ``[B, Hkv, window, D]`` each."""
        if self.contiguous:
            assert not self.prefix_cols, "cache.view reads positions as columns: not in the aligned mode"
            kv = self.regions()[layer, :, slots, :, :window]
            return kv[0], kv[1]
        blocks = self.table[slots, : self.blocks_for(window)].reshape(-1)
        return self.gather(layer, blocks, slots.shape[0], window)

    def gather(self, layer: int, blocks: Tensor, b: int, window: int) -> tuple[Tensor, Tensor]:
        """K and V ``[B, Hkv, window, D]`` of ``b`` slots whose first ``n`` blocks are ``blocks`` ``[B * n]``.

        One ``index_select`` of whole blocks into a contiguous buffer. On CPU the buffer is kept
        and reused (a fresh multi-MB tensor per layer costs page faults that exceed the copy);
        on CUDA the caching allocator makes a fresh one free, and a kept buffer could outlive
        the CUDA-graph pool it was captured in.
        """
        h2, bs, d = 2 * self.num_kv_heads, self.block_size, self.head_dim
        size = h2 * blocks.shape[0] * bs * d
        if self.kv.device.type == "cuda":
            out = None
        else:
            if self._window.numel() < size:  # a normal tensor even when decode runs under inference_mode:
                with torch.inference_mode(False):  # prefill writes into it outside that mode
                    self._window = torch.empty(size, dtype=self.kv.dtype, device=self.kv.device)
            out = self._window[:size].view(h2, blocks.shape[0], bs * d)
        src = self.kv[layer].view(h2, self.num_blocks + 1, bs * d)
        kv = torch.index_select(src, 1, blocks, out=out) if out is not None else src.index_select(1, blocks)
        kv = kv.view(h2, b, -1, d)[:, :, :window].transpose(0, 1)  # [B, 2Hkv, W, D], views
        h = self.num_kv_heads
        return kv[:, :h], kv[:, h:]

    def paged(self, layer: int) -> tuple[Tensor, Tensor]:
        """K and V of every block, ``[NB + 1, BS, Hkv, D]`` views (flash-attn's paged layout)."""
        kv = self.kv[layer].permute(1, 2, 0, 3)
        h = self.num_kv_heads
        return kv[:, :, :h], kv[:, :, h:]

    # ------------------------------------------------------------------ decode attention

    def decode_plan(self, slots: int, pos: Tensor, window: int, dtype: torch.dtype) -> Any:
        """The attention kernel's per-step data for slots ``[0, slots)`` at positions ``pos``."""
        return self.attention.plan(self, slots, pos, window, dtype)

    def attend(self, layer: int, q: Tensor, plan: Any, p: Any) -> Tensor:
        """Decode attention of ``q`` ``[B, Hkv, G, D]`` over the slots' cached positions with the
        layer's settings ``p`` (``rlhf.models.arch.LayerAttn``)."""
        return self.attention.attend(self, layer, q, plan, p)
