"""One ``Sampler.generate`` call: admission, chunked prefill, decode, preemption, retirement.

* The ``N = len(prompts) * n`` sequences wait in a queue (row ``i*n + j`` = sample ``j`` of
  prompt ``i``). Sequences are admitted while there are free slots and free cache blocks
  for their prefix; the distinct prompts of fresh sequences are prefilled once and their
  K/V written into the blocks of all their samples. A prefix longer than the sampler's
  ``prefill_tokens`` is prefilled alone in chunks of that size (chunked prefill).
* Live sequences occupy the slot prefix ``[0, B)``: when sequences finish, their blocks
  return to the free list and the last live slots take over the holes (a block-table row
  move), so decode runs on ``B`` rows and never computes finished ones.
* Before each decode step every live sequence gets a block for its next position. When the
  free blocks do not suffice, the most recently admitted sequences are preempted: their
  blocks are freed and they go back to the front of the queue with the tokens generated so
  far. Re-admitted, ``prompt + generated`` is prefilled again (recompute) and decoding
  continues. Draws are keyed by (seed, step, prompt key, sample, position), so a preempted
  sequence produces the same tokens it would have without the pause.
* Per step: one decode forward, sampling, stop detection and output writes as batched
  tensor ops, and one host sync to learn which sequences finished.
* Multi-turn (``turns``, see ``rlhf.rollout.turns``): a sequence whose turn ended and that
  waits for an observation is parked (its blocks detached from its slot and kept, the slot
  compacted away). Each loop polls the handler; a sequence whose observation came resumes
  in a free slot: ``[stop token] + observation`` is prefilled onto its cached K/V (the
  chunked-prefill path) and decoding continues. Under cache pressure parked sequences are
  preempted before live ones; a preempted one is recomputed from ``prompt + trajectory``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from rlhf.models.batch_invariant import row_log_probs
from rlhf.rollout import speculative
from rlhf.rollout.abort import EarlyStop
from rlhf.rollout.kv_cache import PagedKVCache
from rlhf.rollout.routes import RouteBook, stack_routes
from rlhf.rollout.sampling import SamplingParams, position_keys, sample_next, sequence_keys, uniforms
from rlhf.rollout.turn_steps import TurnSteps
from rlhf.rollout.turns import ParkingLot, TurnHandler


def prefill_layout(lens: list[int], device: torch.device) -> tuple[Tensor, Tensor | None, Tensor]:
    """Prompts of lengths ``lens`` packed back to back: each token's position in its prompt ``[Ttot]``,
    its row in the right-padded ``[P * width]`` grid (None when every prompt has length ``width``) and
    each prompt's end ``[P]`` (``rlhf.models.decoder.prefill``'s index inputs)."""
    width, total = max(lens), sum(lens)
    lengths = torch.tensor(lens, dtype=torch.int64, device=device)
    ends = lengths.cumsum(0)
    row_of = torch.repeat_interleave(torch.arange(len(lens), device=device), lengths)  # [Ttot]
    positions = torch.arange(total, device=device) - (ends - lengths)[row_of]
    grid_index = None if width * len(lens) == total else row_of * width + positions
    return positions, grid_index, ends


class Slots:
    """Per-slot decode state, device tensors with S rows (live slots are the prefix [0, B)).

    ``token`` / ``pos``: next decode input; ``gen``: tokens generated so far; ``seq``: output
    row; ``u``: ``[S, R]`` the slot's pre-drawn uniforms, one per response position
    (sampling only); ``window``: the last generated tokens (stop sequences only).
    """

    def __init__(self, token: Tensor, pos: Tensor, num_new: int, sampling: bool, stop_window: int) -> None:
        num_slots, device = token.shape[0], token.device
        self.token, self.pos = token.zero_(), pos.zero_()
        self.gen = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.seq = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.u = torch.zeros((num_slots, num_new), dtype=torch.float32, device=device) if sampling else None
        self.window = torch.full((num_slots, stop_window), -1, dtype=torch.int64, device=device) if stop_window else None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.token, self.pos, self.gen, self.seq, self.u, self.window) if t is not None]


class GenerateRun(TurnSteps):
    """State of one ``generate`` call (kept out of ``Sampler`` so calls cannot leak state)."""

    def __init__(self, s: Any, prompts: list[list[int]], params: SamplingParams, step: int, keys: list[int],
                 on_finished: Optional[Callable[[list[int], list[list[int]]], None]] = None,
                 turns: Optional[TurnHandler] = None, vision: Any = None,
                 keep_groups: Optional[int] = None, count_group: Any = None):
        """``keep_groups``: over-sampling (``rlhf.rollout.abort``) aborts the rest once that many prompt groups
        finished (over the replicas of ``count_group``). ``vision``: a VLM call's
        ``rlhf.rollout.vision.VisionPrompts`` (prefill embeddings, M-RoPE rows, decode rope deltas). ``on_finished(rows, token_ids)``: called as sequences finish (output rows,
        their tokens), so their rewards can be computed while the others still decode. ``turns``: the multi-turn handler."""
        self.s, self.params, self.prompts = s, params, prompts
        self.vision = vision
        self.unit_prompt: list[int] = []  # prompt of each prefill unit of the current admission
        self.on_finished = on_finished
        self.lot = None if turns is None else ParkingLot(turns, s.spec.vocab_size, params.max_new_tokens)
        dev = s.device
        n, self.n = params.n, params.n
        self.N = N = len(prompts) * n
        self.R = R = params.max_new_tokens
        self.cache: PagedKVCache = s.cache
        self.S = self.cache.num_slots
        # K/V read in place through fixed slot regions when nothing needs paging (no parking)
        self.prompt_lens = [len(p) for p in prompts]
        # a cascade kernel (rlhf.rollout.cascade_attention) pages when a group may share its prompt blocks
        wants_paged = getattr(self.cache.attention, "prefers_paged", None)
        aligned = self._aligned_prefix(n, vision)
        regions = s.slot_regions and turns is None and not self.cache.attention.in_place
        shares = s.prefix_sharing and wants_paged is not None and wants_paged(
            self.prompt_lens, n, self.cache.block_size, aligned=bool(aligned) and regions and self.cache.fits_every_slot)
        self.cache.start(contiguous=regions and not shares, prefix_cols=aligned)
        self.share_prefix = s.prefix_sharing and not self.cache.contiguous
        seq = torch.arange(N, device=dev)
        keys_t = torch.tensor(keys, dtype=torch.int64, device=dev)
        self.seq_key = sequence_keys(params.seed, step, keys_t[seq // n], seq % n)  # [N]
        self.pos_key = position_keys(R, dev)  # [R]
        self.out_ids = torch.full((N, R), s.pad_token_id, dtype=torch.int64, device=dev)
        self.out_logp = torch.zeros((N, R), dtype=torch.float32, device=dev)
        self.out_len = torch.zeros(N, dtype=torch.int64, device=dev)
        self.out_stopped = torch.zeros(N, dtype=torch.bool, device=dev)
        # observation tokens of multi-turn trajectories (the holes of the response mask)
        self.out_obs = torch.zeros((N, R), dtype=torch.bool, device=dev) if turns is not None else None
        # each fed token's MoE expert ids (Sampler(record_routes=True): rlhf.rollout.routes)
        self.routes = RouteBook(N, max(self.prompt_lens), R, s.route_shape, dev) if s.route_shape else None
        for i, length in enumerate(self.prompt_lens if self.routes is not None else []):
            self.routes.start_rows(list(range(i * n, (i + 1) * n)), length, clear=False)
        self.stop_ids = torch.tensor(sorted({int(t) for t in params.stop_token_ids}), dtype=torch.int64, device=dev)
        stops = [list(map(int, q)) for q in params.stop_sequences]
        self.stop_len = max((len(q) for q in stops), default=0)
        if stops:  # right-aligned in a [Q, L] table; -2 (never a token) where a stop is shorter
            table = torch.full((len(stops), self.stop_len), -2, dtype=torch.int64)
            for i, q in enumerate(stops):
                table[i, self.stop_len - len(q):] = torch.tensor(q)
            self.stop_table = table.to(dev)
            self.stop_care = self.stop_table >= 0
        self.slots = Slots(s.token_buf, s.pos_buf, R, not params.greedy, self.stop_len)
        # host mirrors, per slot: pos = pos_base + decode_steps; output row; admission number
        self.pos_base = [0] * self.S
        self.slot_seq = [0] * self.S
        self.slot_order = [0] * self.S
        self.live = 0  # live slots are [0, live)
        self.queue: deque[int] = deque(range(N))  # waiting sequences, front first
        self.resume_gen = [0] * N  # trajectory length of a preempted sequence (recomputed when re-admitted)
        self.turn_start = [0] * N  # response position where the current assistant turn began
        self.admitted = 0
        self._grow_at = 0  # first decode step at which a live slot needs another block (0: recompute)
        self._ends = [0] * self.S  # per slot: the _grow_at bound (_reserve_next_positions)
        # full decode steps ahead that retire no slot (no stop criteria: every slot runs to R; _retire_done)
        self._quiet = 0
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "prefill_calls": 0,
                      "prefill_tokens": 0, "prefill_padded_tokens": 0, "slot_steps": 0, "compaction_moves": 0,
                      "preemptions": 0, "recomputed_tokens": 0, "peak_blocks": 0, "turns": 0,
                      "observation_tokens": 0, "parked_preemptions": 0,
                      "shared_blocks": 0}
        self.spec = speculative.for_run(self)  # None unless rollout.speculative is on and applies
        self.early = None if keep_groups is None else \
            EarlyStop(keep_groups, len(prompts), n, count_group, lockstep=s.tp_group is not None)

    # ------------------------------------------------------------------ main loop

    def execute(self) -> dict:
        t_start = time.perf_counter()
        threshold = max(1, int(self.s.refill_fraction * self.S))
        lot = self.lot
        while True:
            if self.early is not None and self.early.reached():
                self.early.stop(self)
                break
            if lot is not None and lot.parked:
                self._take_observations(wait=False)
                if lot.ready and self.live < self.S:
                    self._resume()
                    continue
            free, waiting = self.S - self.live, len(self.queue)
            if waiting and free and (self.live == 0 or free >= min(waiting, threshold)):
                admit = self._fitting(free)
                if admit:
                    self._admit(admit)
                    continue  # admitted sequences may finish at once (stop on the first token)
            if self.live == 0:
                if lot is not None and lot.parked:  # everything waits for tools
                    self._take_observations(wait=True)
                    continue
                if self.early is not None:
                    self.early.wait_for_peers()
                break  # nothing live and nothing waiting (a lone sequence always fits: checked at allocation)
            self._reserve_next_positions()
            self._decode_step()
        return self._finish(time.perf_counter() - t_start)

    aligns_prompts = True  # a run whose prompts are known at the start (StreamRun's arrive later)

    def _aligned_prefix(self, n: int, vision: Any) -> int:
        """Prompt columns of the aligned contiguous cache (``rlhf.rollout.region_cascade``: a GRPO group's
        prompt read once per decode step), or 0 (positions are columns). Only where nothing reads the
        cache by positions: no speculative verify, VLM or chunked prefill; eager decode. fp32 only: in
        bf16 / fp16 the split prompt / response sum of the attention output adds a rounding step."""
        s = self.s
        if (n < 2 or not self.aligns_prompts or not getattr(self.cache.attention, "aligns", False)
                or s.dtype != torch.float32 or s.batch_invariant
                or vision is not None or s.static_shapes or getattr(s.speculative, "enable", False)
                or max(self.prompt_lens) > s.prefill_tokens):
            return 0
        return max(self.prompt_lens)

    def _prefix_len(self, q: int) -> int:
        return self.prompt_lens[q // self.n] + self.resume_gen[q]

    def _shared_blocks(self, q: int) -> int:
        """Full prompt blocks a fresh sequence shares with the samples of its prompt admitted with it."""
        if not self.share_prefix or self.resume_gen[q]:
            return 0
        return self.prompt_lens[q // self.n] // self.cache.block_size

    def _fitting(self, free_slots: int) -> list[int]:
        """Sequences from the queue front whose prefix (+ the first decoded position) fits."""
        out, blocks, prompts = [], self.cache.num_free, set()
        for q in list(self.queue)[:free_slots]:
            need = self.cache.blocks_for(self._prefix_len(q) + 1)
            if q // self.n in prompts:
                need -= self._shared_blocks(q)
            elif not self.resume_gen[q]:
                prompts.add(q // self.n)
            if need > blocks:
                break
            blocks -= need
            out.append(q)
        return out

    # ------------------------------------------------------------------ admission

    def _admit(self, seqs: list[int]) -> None:
        """Prefill the prefixes of ``seqs`` (the queue front) into slots [live, live + m)."""
        t0 = time.perf_counter()
        s, dev, n = self.s, self.s.device, self.n
        m, a = len(seqs), self.live
        for _ in seqs:
            self.queue.popleft()
        prefix_len = [self._prefix_len(q) for q in seqs]
        self._take_blocks(seqs, prefix_len)
        # prefill units: a fresh prompt once for all its admitted samples; a resumed sequence alone
        unit_of: dict[tuple[int, int], int] = {}
        units: list[list[int]] = []
        self.unit_prompt = []
        slot_unit = []
        for q in seqs:
            g = self.resume_gen[q]
            key = (q // n, -1) if g == 0 else (q // n, q)
            if key not in unit_of:
                unit_of[key] = len(units)
                tokens = self.prompts[q // n] + (self.out_ids[q, :g].tolist() if g else [])
                units.append(tokens)
                self.unit_prompt.append(q // n)
            slot_unit.append(unit_of[key])
        if self.cache.prefix_cols:  # the aligned cache's groups: process-unique prefill-unit ids
            first = self.cache.new_units(len(units))
            self.cache.align(list(range(a, a + m)), [self.prompt_lens[q // n] for q in seqs],
                             [first + u for u in slot_unit])
        logits = torch.empty((len(units), s.spec.vocab_size), dtype=torch.float32, device=dev)
        slot_unit_t = torch.tensor(slot_unit, dtype=torch.int64, device=dev)
        for chunk in self._prefill_chunks(units):
            members = [j for j, u in enumerate(slot_unit) if u in chunk]
            rows = [chunk.index(slot_unit[j]) for j in members]
            slot_ids = torch.tensor([a + j for j in members], dtype=torch.int64, device=dev)
            out = self._prefill(chunk, units, slot_ids, rows, [seqs[j] for j in members], [a + j for j in members])
            logits.index_copy_(0, torch.tensor(chunk, dtype=torch.int64, device=dev), out)
        gen0 = [self.resume_gen[q] for q in seqs]
        self._place(seqs, gen0, list(range(self.admitted, self.admitted + m)))
        self.admitted += m
        self.stats["recomputed_tokens"] += sum(gen0)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self._sample_and_retire(a, a + m, logits[slot_unit_t])

    def _place(self, seqs: list[int], gen0: list[int], orders: list[int]) -> None:
        """Slots ``[live, live + m)`` take sequences ``seqs`` whose trajectories (length ``gen0``)
        are in the cache; their next token is sampled from the logits after the last one."""
        sl, dev = self.slots, self.s.device
        a = self.live
        b = a + len(seqs)
        seqs_t = torch.tensor(seqs, dtype=torch.int64, device=dev)
        prefix_len = [self.prompt_lens[q // self.n] + g for q, g in zip(seqs, gen0)]
        sl.seq[a:b] = seqs_t
        sl.gen[a:b] = torch.tensor(gen0, dtype=torch.int64, device=dev)
        # the next sampled token is fed at position len(prefix); the shared update below adds 1
        sl.pos[a:b] = torch.tensor(prefix_len, dtype=torch.int64, device=dev) - 1
        if sl.u is not None:  # all the uniforms these sequences will use, drawn at once
            sl.u[a:b] = uniforms(self.seq_key[seqs_t, None], self.pos_key[None, :])
        if sl.window is not None:  # the stop window holds the current turn's generated tokens
            win = torch.full((len(seqs), self.stop_len), -1, dtype=torch.int64, device=dev)
            for j, (q, g) in enumerate(zip(seqs, gen0)):
                k = min(g - self.turn_start[q], self.stop_len)
                if k:
                    win[j, self.stop_len - k:] = self.out_ids[q, g - k:g]
            sl.window[a:b] = win
        steps = self.stats["decode_steps"]
        self.pos_base[a:b] = [p - steps for p in prefix_len]
        self.slot_seq[a:b] = seqs
        self.slot_order[a:b] = orders
        self.live = b
        self._grow_at = 0
        self._quiet = 0  # the new slots may finish sooner than the bound assumed

    def _take_blocks(self, seqs: list[int], prefix_len: list[int]) -> None:
        """Blocks for slots ``[live, live + m)``: the fresh samples of a prompt share the prompt's
        full blocks with the first of them (ref-counted; its partial last block, which decoding
        writes to, is each sample's own)."""
        a, cache = self.live, self.cache
        lead: dict[int, int] = {}
        followers: dict[int, list[int]] = {}
        for j, q in enumerate(seqs):
            if self._shared_blocks(q):
                if q // self.n in lead:
                    followers.setdefault(q // self.n, []).append(a + j)
                    continue
                lead[q // self.n] = a + j
        rest = {slot for dst in followers.values() for slot in dst}
        first = [j for j in range(len(seqs)) if a + j not in rest]
        cache.grow([a + j for j in first], [prefix_len[j] + 1 for j in first])
        for p, dst in followers.items():
            count = self.prompt_lens[p] // cache.block_size
            cache.share(lead[p], dst, count)
            self.stats["shared_blocks"] += count * len(dst)
        later = sorted(rest)
        cache.grow(later, [prefix_len[slot - a] + 1 for slot in later])

    def _prefill_chunks(self, units: list[list[int]]) -> list[list[int]]:
        """Unit indices grouped into prefill forwards of at most ``prefill_tokens`` tokens
        (sorted by length: similar widths share an attention grid); a longer unit is alone."""
        order = sorted(range(len(units)), key=lambda i: len(units[i]))
        chunks: list[list[int]] = [[]]
        used = 0
        for i in order:
            if chunks[-1] and used + len(units[i]) > self.s.prefill_tokens:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += len(units[i])
        return chunks

    def _prefill(self, chunk: list[int], units: list[list[int]], slot_ids: Tensor, rows: list[int],
                 seqs: list[int], slots: list[int]) -> Tensor:
        """Logits ``[len(chunk), V]`` after each unit's prefix; K/V written for ``slot_ids`` (``slots`` on the
        host; output rows ``seqs``, whose routes are recorded); ``rows``: the chunk position of each slot's unit."""
        s, dev = self.s, self.s.device
        lens = [len(units[i]) for i in chunk]
        width, total = max(lens), sum(lens)
        self.stats["prefill_tokens"] += total
        mm = None if self.vision is None else [self.vision.unit(self.unit_prompt[i], units[i]) for i in chunk]
        if len(chunk) == 1 and total > s.prefill_tokens:  # one long prefix: chunked prefill
            return self._extend(units[chunk[0]], 0, slot_ids, None if mm is None else mm[0], seqs)
        ids = torch.tensor([t for i in chunk for t in units[i]], dtype=torch.int64, device=dev)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        positions, grid_index, ends = prefill_layout(lens, dev)
        self.stats["prefill_calls"] += 1
        self.stats["prefill_padded_tokens"] += width * len(chunk)
        routes = [] if self.routes is not None else None
        if mm is not None:  # the prompts' own rope rows (M-RoPE) and embeddings (image features placed)
            cos, sin = torch.cat([u.cos for u in mm])[None], torch.cat([u.sin for u in mm])[None]
            deep = None if mm[0].deepstack is None else torch.cat([u.deepstack for u in mm], dim=1)
            out = s.backend.prefill(s.spec, s.weights, self.cache, ids, torch.arange(total, device=dev), grid_index,
                                  width, ends - 1, slot_ids, rows_t, cos, sin, s.tp_group,
                                  torch.cat([u.embeds for u in mm]), deep, routes=routes)
        else:
            # slot regions: each prompt's K/V copied into its samples' regions per run of slots (no per-row index)
            runs = self.cache.prefill_runs(slots, rows, width)
            out = s.backend.prefill(s.spec, s.weights, self.cache, ids, positions, grid_index, width, ends - 1,
                                  slot_ids, rows_t, s.cos, s.sin, s.tp_group, routes=routes, runs=runs)
        if routes is not None:  # each slot's unit: its tokens' routes from the packed forward
            r, first = stack_routes(routes), [0] + list(itertools.accumulate(lens))  # (host: no sync)
            for q, u in zip(seqs, rows):
                self.routes.write_span(q, 0, r[first[u]:first[u + 1]])
        return out

    def _extend(self, tokens: list[int], start: int, slot_ids: Tensor, mm: Any = None,
                seqs: Optional[list[int]] = None, rope_shift: int = 0) -> Tensor:
        """Prefill ``tokens`` at positions ``[start, start + len)`` onto the cached positions
        ``[0, start)`` of ``slot_ids[0]`` (K/V written to every slot in ``slot_ids``), in chunks of
        ``prefill_tokens``; logits ``[1, V]`` after the last token. ``mm``: a VLM prompt's inputs
        (``rlhf.rollout.vision.PromptInputs``, positions from 0; ``start`` must then be 0).
        ``seqs``: the slots' output rows (their routes are recorded)."""
        s = self.s
        ids = torch.tensor(tokens, dtype=torch.int64, device=s.device)
        c = s.prefill_tokens
        cos, sin = (s.cos, s.sin) if mm is None else (mm.cos[None], mm.sin[None])
        for i in range(0, len(tokens), c):
            routes = [] if self.routes is not None else None
            out = s.backend.prefill_chunk(s.spec, s.weights, self.cache, ids[i:i + c], start + i, slot_ids,
                                        cos, sin, s.tp_group, None if mm is None else mm.embeds[i:i + c],
                                        None if mm is None or mm.deepstack is None else mm.deepstack[:, i:i + c],
                                        routes=routes, rope_shift=rope_shift)
            for q in seqs if routes is not None else []:
                self.routes.write_span(q, start + i, stack_routes(routes))
            self.stats["prefill_calls"] += 1
        self.stats["prefill_padded_tokens"] += len(tokens)
        return out

    # ------------------------------------------------------------------ multi-turn

    # ------------------------------------------------------------------ decode

    def _reserve_next_positions(self) -> None:
        """Give every live slot a block for the position it writes next; preempt if none is left."""
        steps, cache = self.stats["decode_steps"], self.cache
        if steps < self._grow_at:  # no live slot reaches the end of its last block this step
            return
        bs, owned, base, ends = cache.block_size, cache.owned, self.pos_base, self._ends
        while True:
            if self._grow_at == 0:  # slots were placed, moved or advanced unevenly: every slot's bound again
                ends[:self.live] = [len(o) * bs - pb for pb, o in zip(base[:self.live], owned)]
            # ends[i]: a lower bound of the first step at which slot i needs another block (exact but for
            # blocks grown elsewhere, e.g. a speculative draft's); only the slots at their bound are checked,
            # not all of them (at batch 128 this runs on most steps of a short call)
            due = [i for i, e in enumerate(ends[:self.live]) if e <= steps]
            extra = [(base[i] + steps + bs) // bs - len(owned[i]) for i in due]  # blocks_for(pos + 1) - held
            total = sum(e for e in extra if e > 0)
            if total <= cache.num_free:
                short = [i for i, e in zip(due, extra) if e > 0]
                cache.grow(short, [base[i] + steps + 1 for i in short])
                for i in due:
                    ends[i] = len(owned[i]) * bs - base[i]
                break
            self._grow_at = 0  # parked blocks freed or a slot preempted (compacted): recompute the bounds
            if self._evict_parked(total):
                continue
            victim = max(range(self.live), key=lambda i: self.slot_order[i])  # the latest admitted
            self._preempt(victim)
        used = cache.num_used
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], used)
        self._grow_at = min(ends[:self.live])

    def _preempt(self, slot: int) -> None:
        q = self.slot_seq[slot]
        # tokens generated so far: the one at the current position is sampled but not yet cached
        self.resume_gen[q] = self.pos_base[slot] + self.stats["decode_steps"] - self.prompt_lens[q // self.n] + 1
        self.queue.appendleft(q)
        self.stats["preemptions"] += 1
        self._compact([slot])

    def _decode_step(self) -> None:
        if self.spec is not None and self.spec.decode_step():  # drafts verified in one forward did the step
            return
        t0 = time.perf_counter()
        s, b = self.s, self.live
        if self.cache.prefix_cols:  # aligned cache: columns [0, max column]; one column for all: step_column
            steps = self.stats["decode_steps"]
            cols = list(map(sum, zip(self.pos_base[:b], self.cache.shift_host[:b])))
            lo, hi = min(cols), max(cols)
            need = hi + steps + 1
            self.cache.step_column = hi + steps if lo == hi else None
        else:
            need = max(self.pos_base[:b]) + self.stats["decode_steps"] + 1  # positions [0, max pos]
        window = min(self.cache.max_seq_len, need)
        rope = None
        if self.vision is not None:  # text positions after the images: cache position + the prompt's delta
            sl = self.slots
            rope = sl.pos[:b] + self.vision.deltas[sl.seq[:b] // self.n]
        logits = s.decode_logits(b, window, rope)
        if self.routes is not None:  # the fed tokens (positions pos) took these experts
            self.routes.write_steps(self.slots.seq[:b], self.slots.pos[:b], s.step_routes)
        self.stats["decode_steps"] += 1  # advances every live slot's host position by one
        self.stats["slot_steps"] += b
        self._sample_and_retire(0, b, logits)
        self.stats["decode_s"] += time.perf_counter() - t0

    def _sample_and_retire(self, a: int, b: int, logits: Tensor) -> None:
        """Sample the next token of live slots [a, b), record it, retire finished sequences."""
        sl, p = self.slots, self.params
        gen, seq = sl.gen[a:b], sl.seq[a:b]
        with self.s.lean():  # writes only into state made outside it; its own results are only read later
            u = None if sl.u is None else sl.u[a:b].gather(1, gen[:, None]).squeeze(1)
            banned = self.s.banned_ids
            if self.s.batch_invariant:  # the trainer's log-prob function, row-tiled (rlhf.models.batch_invariant)
                tok, _ = sample_next(logits, p, u)
                logp = row_log_probs(logits, tok, 1.0 if p.greedy else p.temperature)[0]
            elif banned is None or not banned.numel():
                tok, logp = sample_next(logits, p, u)
            else:  # never draw an image / video placeholder; the log-prob stays the untruncated policy's
                tok, _ = sample_next(logits.index_fill(1, banned, float("-inf")), p, u)
                scaled = logits if p.greedy or p.temperature == 1.0 else logits / p.temperature
                logp = torch.log_softmax(scaled, dim=-1).gather(1, tok[:, None]).squeeze(1)
            self.out_ids.index_put_((seq, gen), tok)
            self.out_logp.index_put_((seq, gen), logp)
            stopped: Tensor | None = None
            if self.stop_ids.numel():
                stopped = torch.isin(tok, self.stop_ids)
            if sl.window is not None:
                win = torch.cat((sl.window[a:b, 1:], tok[:, None]), dim=1)
                sl.window[a:b] = win
                match = ((win[:, None, :] == self.stop_table[None]) | ~self.stop_care[None]).all(-1).any(-1)
                stopped = match if stopped is None else stopped | match
            gen += 1  # in place on the slot state
            sl.token[a:b] = tok
            sl.pos[a:b] += 1
            if stopped is None and self._quiet > 0 and a == 0 and b == self.live:
                self._quiet -= 1  # no live slot reaches max_new_tokens at this step: no retire check, no sync
                return
            done = gen >= self.R if stopped is None else stopped | (gen >= self.R)
        self._retire_done(a, seq, gen, stopped, done)

    def _retire_done(self, a: int, seq: Tensor, gen: Tensor, stopped: Tensor | None, done: Tensor) -> None:
        """Retire the slots ``a + i`` where ``done[i]``: the value-dependent half of a step (the
        simulation, ``rlhf/ops/sim_rollout.py``, stops before it)."""
        with self.s.lean():
            finished = done.nonzero().squeeze(1)
            if stopped is None and self.spec is None and a == 0 and gen.shape[0] == self.live:
                # only max_new_tokens ends a sequence and every live slot samples once per step: the slot
                # closest to R bounds the steps that retire nothing (_quiet; new slots reset it in _place)
                left = torch.where(done, self.R, self.R - gen).amin().view(1)
                host = torch.cat((finished, left)).tolist()  # the one host sync of a step
                fin, self._quiet = host[:-1], host[-1] - 1
            else:
                fin = finished.tolist()  # the one host sync of a step
        self._retire(a, seq, gen, stopped, finished, fin)

    def _retire(self, a: int, seq: Tensor, gen: Tensor, stopped: Tensor | None, finished: Tensor,
                fin: list[int]) -> None:
        """Finish (or park, at a turn's end) the slots ``a + fin`` (``finished`` on the device) of slots [a, b)."""
        if not fin:
            return
        fs, lens = seq[finished], gen[finished]
        stop_f = stopped[finished] if stopped is not None else torch.zeros_like(fs, dtype=torch.bool)
        if self.lot is not None and stopped is not None:
            keep = self._end_turns([a + i for i in fin], fs.tolist(), lens.tolist(), stop_f.tolist())
            if len(keep) < len(fin):
                sel = torch.tensor(keep, dtype=torch.int64, device=fs.device)
                fs, lens, stop_f = fs[sel], lens[sel], stop_f[sel]
        self._finish_rows(fs, lens, stop_f)
        self._compact([a + i for i in fin])

    def _finish_rows(self, rows: Tensor, lens: Tensor, stopped: Tensor) -> None:
        """Record finished output rows (device tensors ``[k]``) and report them to ``on_finished``."""
        if rows.numel() == 0:
            return
        self.out_len[rows] = lens
        self.out_stopped[rows] = stopped
        if self.early is not None:
            self.early.finished(rows.tolist(), lens.tolist())
        if self.on_finished is not None:
            ids = self.out_ids[rows].tolist()
            self.on_finished(rows.tolist(), [r[:n] for r, n in zip(ids, lens.tolist())])

    def _compact(self, dead: list[int]) -> None:
        """Free the blocks of ``dead`` slots and move the last live slots into the holes."""
        self.cache.release(dead)
        new_live = self.live - len(dead)
        dead_set = set(dead)
        holes = [i for i in dead if i < new_live]
        movers = [i for i in range(new_live, self.live) if i not in dead_set]
        if holes:
            dev = self.s.device
            src = torch.tensor(movers, dtype=torch.int64, device=dev)
            dst = torch.tensor(holes, dtype=torch.int64, device=dev)
            self.cache.move(movers, holes)
            for t in self.slots.tensors():
                t.index_copy_(0, dst, t.index_select(0, src))
            for h, m in zip(holes, movers):
                self.pos_base[h], self.slot_seq[h], self.slot_order[h] = \
                    self.pos_base[m], self.slot_seq[m], self.slot_order[m]
            self.stats["compaction_moves"] += len(holes)
        # Vacated slots [new_live, live) still run in the static all-slot decode (CUDA graphs): reset
        # them to position 0, token 0. A stale position made flash-attn read its whole old length,
        # and past the step's key window (sliding-window layers) a slot saw no key at all: NaN K/V
        # written into the scratch block that live rows read (masked, but 0 * NaN = NaN).
        if new_live < self.live:
            self.slots.token[new_live:self.live] = 0
            self.slots.pos[new_live:self.live] = 0
        self.live = new_live
        self._grow_at = 0

    # ------------------------------------------------------------------ output

    def _finish(self, total_s: float) -> dict:
        N, R = self.N, self.R
        lengths = self.out_len
        mask = torch.arange(R, device=lengths.device)[None, :] < lengths[:, None]
        if self.out_obs is not None:
            mask &= ~self.out_obs
        tokens = int(mask.sum())  # generated tokens (observations excluded)
        st = self.stats
        used = min(self.S, N)
        stats = {
            "tokens_generated": float(tokens),
            "num_sequences": float(N),
            "seconds": total_s,
            "tokens_per_s": tokens / total_s if total_s > 0 else 0.0,
            "prefill_s": st["prefill_s"],
            "decode_s": st["decode_s"],
            "decode_steps": float(st["decode_steps"]),
            "prefill_calls": float(st["prefill_calls"]),
            "prefill_tokens": float(st["prefill_tokens"]),
            "prefill_padded_tokens": float(st["prefill_padded_tokens"]),
            "num_slots": float(self.S),
            "slot_utilisation": st["slot_steps"] / (st["decode_steps"] * used) if st["decode_steps"] else 1.0,
            "compaction_moves": float(st["compaction_moves"]),
            "kv_cache_bytes": float(self.cache.nbytes),
            "kv_cache_tokens": float(self.cache.capacity_tokens),
            "kv_peak_tokens": float(st["peak_blocks"] * self.cache.block_size),
            "preemptions": float(st["preemptions"]),
            "recomputed_tokens": float(st["recomputed_tokens"]),
            "kv_shared_blocks": float(st["shared_blocks"]),
        }
        if self.spec is not None:
            stats.update(self.spec.stats())
        if self.early is not None:
            stats.update(self.early.stats())
        if self.lot is not None:
            stats["turns"] = float(st["turns"])
            stats["observation_tokens"] = float(st["observation_tokens"])
            stats["parked_preemptions"] = float(st["parked_preemptions"])
        return {"response_ids": self.out_ids, "response_mask": mask, "log_probs": self.out_logp,
                "response_lengths": lengths, "routes": None if self.routes is None else self.routes.table(),
                "truncated": ~self.out_stopped, "prompt_index": torch.arange(N, device=lengths.device) // self.n,
                "aborted": None if self.early is None else self.early.row_flags(lengths.device),
                "stats": stats}
