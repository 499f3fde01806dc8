"""Batched KV-cache sampler: prefill once per prompt, continuous-batching decode.

Scheduling (one ``generate`` call):

* The ``N = len(prompts) * n`` sequences wait in a queue (row ``i*n + j`` = sample ``j`` of
  prompt ``i``). Free cache slots are filled from it; the distinct prompts of the admitted
  sequences are prefilled once (right-padded batch) and their K/V copied into the slots of
  all their samples.
* Live sequences always occupy the slot prefix ``[0, B)``: when sequences finish, the last
  live slots are moved into the holes (a K/V copy of the used positions), so decode runs
  on contiguous cache views and never computes finished rows. Freed slots are refilled
  from the queue as soon as ``refill_fraction`` of the slots are free.
* Per step: one decode forward for all live slots, sampling, stop detection and output
  writes as batched tensor ops, and one host sync to learn which sequences finished.

With ``use_cuda_graph`` (CUDA only) the decode forward runs on all slots with a fixed
attention window so that its shapes are static, and is captured once as a CUDA graph.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.rollout import decoder
from rlhf.rollout.kv_cache import StaticKVCache, kv_bytes_per_token, kv_tokens_for_memory, num_slots_for
from rlhf.rollout.sampling import SamplingParams, position_keys, sample_next, sequence_keys, uniforms


@dataclass
class RolloutOutput:
    """Responses of one ``generate`` call; ``N = len(prompts) * n``, ``R = max_new_tokens``.

    Row ``i * n + j`` is sample ``j`` of prompt ``i``. ``log_probs`` are
    ``log_softmax(logits / T)`` of the sampled tokens (T = 1 for greedy), before any
    top-k / top-p / min-p truncation; see ``rlhf.rollout.sampling``.
    """

    response_ids: Tensor  # [N, R] long, pad_token_id after the response
    response_mask: Tensor  # [N, R] bool, True on generated tokens (incl. the stop token)
    log_probs: Tensor  # [N, R] float32, 0 on padding
    response_lengths: Tensor  # [N] long
    truncated: Tensor  # [N] bool: hit max_new_tokens without a stop
    prompt_index: Tensor  # [N] long: index into `prompts`
    stats: dict[str, float] = field(default_factory=dict)


class _Slots:
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


class Sampler:
    """KV-cache generation engine over a plain HF-named weight dict (see module docstring).

    Args:
        model_config: HF config of a llama / mistral / qwen2 / qwen3 causal LM.
        weights: HF state-dict names -> tensors (``lm_head.weight`` optional when tied).
        pad_token_id: fills ``response_ids`` after each response.
        device, dtype: where / in which precision to run (dtype defaults to the weights').
        max_num_seqs: most sequences decoded at once (cache slots).
        max_seq_len: prompt + response capacity of a slot. ``None``: sized at the first
            ``generate`` call from the longest prompt + ``max_new_tokens`` (rounded up to a
            multiple of 64) and grown only when a later call needs more.
        kv_cache_tokens: token budget of the cache; slots = min(max_num_seqs, budget // max_seq_len).
        refill_fraction: admit waiting sequences once this fraction of the slots is free
            (0 = refill after every finish). Batching admissions amortises prefill calls.
        prefill_tokens: padded-token budget of one prefill forward (longer admissions are chunked).
        use_cuda_graph: run decode on all slots with power-of-two attention windows (static
            shapes) and capture each window's step as a CUDA graph (CUDA devices only).
        tp_group: process group of a tensor-parallel rollout. ``weights`` then hold this rank's
            slice: rows of q/k/v and gate/up (column parallel), columns of o_proj / down_proj
            (row parallel, outputs all-reduced over the group), everything else full. Every
            rank computes full-vocab logits and draws the same tokens. None: no TP.
        gpu_memory_utilization: on CUDA without ``kv_cache_tokens``, cap the cache at this
            fraction of the device memory free when it is allocated (after the weights), so a
            large ``max_num_seqs`` x ``max_seq_len`` shrinks to the slots that fit instead of
            running out of memory. None: no cap.
    """

    def __init__(
        self,
        model_config: Any,
        weights: Mapping[str, Tensor],
        *,
        pad_token_id: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_num_seqs: int = 256,
        max_seq_len: int | None = None,
        kv_cache_tokens: int | None = None,
        refill_fraction: float = 0.0,
        prefill_tokens: int = 8192,
        use_cuda_graph: bool = False,
        tp_group: Any = None,
        gpu_memory_utilization: float | None = None,
    ) -> None:
        self.device = torch.device(device)
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs a CUDA device, got device={self.device}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.config = model_config
        self.spec = decoder.DecoderSpec.from_config(model_config)
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp_size > 1:  # weights hold this rank's heads / MLP columns (rlhf.rollout.reshard layout)
            self.spec = self.spec.shard(tp_size)
        else:
            tp_group = None  # a group of one: nothing to all-reduce
        self.pad_token_id = int(pad_token_id)
        self.dtype = dtype or next(iter(weights.values())).dtype
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.refill_fraction = refill_fraction
        self.prefill_tokens = prefill_tokens
        self.use_cuda_graph = use_cuda_graph
        # static decode shapes: all slots, bucketed windows (what a CUDA graph needs; also
        # runnable on CPU, which is how the static path is tested without a GPU)
        self.static_shapes = use_cuda_graph
        self.tp_group = tp_group
        self._inv_freq, self._rope_scale = decoder.rope_inv_freq(model_config, self.spec.head_dim)
        self.weights = decoder.prepare_weights(self.spec, weights, device=self.device, dtype=self.dtype)
        self.cache: StaticKVCache | None = None
        self.max_seq_len = 0
        self._graphs: dict[int, tuple[Any, Tensor]] = {}  # window -> (CUDAGraph, logits buffer)
        self._graph_pool: Any = None
        self._fixed_len = max_seq_len is not None
        if max_seq_len is not None:
            self._allocate(max_seq_len)

    # ------------------------------------------------------------------ setup

    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Swap in new weights (e.g. after a training step); the KV cache is kept.

        Captured CUDA graphs read the weights at fixed addresses, so when there are any the
        new values are copied into the old tensors and the graphs (and their memory pool)
        are replayed as they are: no re-capture per training step.
        """
        new = decoder.prepare_weights(self.spec, weights, device=self.device, dtype=self.dtype)
        if self._graphs:
            decoder.copy_weights_(self.weights, new)
        else:
            self.weights = new

    def _allocate(self, max_seq_len: int) -> None:
        self.spec.check_seq_len(max_seq_len)
        self.cache = None  # free the old buffers first (and count them as free below)
        budget = self.kv_cache_tokens
        if budget is None and self.gpu_memory_utilization is not None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_token = kv_bytes_per_token(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.dtype)
            budget = min(self.max_num_seqs * max_seq_len, kv_tokens_for_memory(free, self.gpu_memory_utilization, per_token))
            if self.tp_group is not None:  # TP peers decode in lockstep: the same slot count on each
                t = torch.tensor([budget], dtype=torch.int64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
                budget = int(t)
        slots = num_slots_for(self.max_num_seqs, max_seq_len, budget)
        self.cache = StaticKVCache(
            self.spec.num_layers, slots, self.spec.num_kv_heads, max_seq_len, self.spec.head_dim,
            dtype=self.dtype, device=self.device,
        )
        self.max_seq_len = max_seq_len
        self.cos, self.sin = decoder.rope_tables(self._inv_freq, self._rope_scale, max_seq_len, self.dtype, self.device)
        # decode inputs live at fixed addresses (CUDA graphs read them in place)
        self.token_buf = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.pos_buf = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self._graphs = {}

    def _ensure_capacity(self, need: int) -> None:
        if need <= self.max_seq_len:
            return
        if self._fixed_len:
            raise ValueError(
                f"longest prompt + max_new_tokens = {need} exceeds max_seq_len={self.max_seq_len}; "
                "raise Sampler(max_seq_len=...) or shorten prompts / max_new_tokens"
            )
        self._allocate(-(-need // 64) * 64)

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        step: int = 0,
        prompt_keys: list[int] | None = None,
    ) -> RolloutOutput:
        """Generate ``params.n`` responses per prompt (see ``RolloutOutput`` for the layout).

        ``prompt_keys`` (default ``range(len(prompts))``) are the prompts' global dataset
        indices: with ``params.seed`` and ``step`` they key the random draws, so the same
        prompt key yields the same responses whatever the batch or rank it is generated on.
        """
        params.validate(self.spec.vocab_size)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: prompts must be a non-empty list of non-empty token lists")
        if prompt_keys is None:
            prompt_keys = list(range(len(prompts)))
        if len(prompt_keys) != len(prompts):
            raise ValueError(f"generate: {len(prompt_keys)} prompt_keys for {len(prompts)} prompts")
        max_new = params.max_new_tokens
        self._ensure_capacity(max(len(p) for p in prompts) + max_new)
        return _Run(self, prompts, params, step, prompt_keys).execute()

    # ------------------------------------------------------------------ decode forward

    def decode_logits(self, live: int, window: int) -> Tensor:
        """Logits ``[live, V]`` of one decode step of slots ``[0, live)`` (inputs in token/pos_buf)."""
        if not self.static_shapes:
            return decoder.decode(self.spec, self.weights, self.cache, self.token_buf[:live], self.pos_buf[:live],
                                  window, self.cos, self.sin, self.tp_group)
        window = min(self.max_seq_len, max(64, 1 << (window - 1).bit_length()))
        if not self.use_cuda_graph:
            return decoder.decode(self.spec, self.weights, self.cache, self.token_buf, self.pos_buf,
                                  window, self.cos, self.sin, self.tp_group)[:live]
        if window not in self._graphs:
            self._capture(window)
        graph, logits = self._graphs[window]
        graph.replay()
        return logits[:live]

    def _capture(self, window: int) -> None:
        """Capture the all-slot decode step for ``window`` as a CUDA graph (CUDA only).

        The warm-up runs write the K/V of each slot's current token at its current position,
        the same values the replay writes, so capturing in the middle of a run is harmless.
        """
        args = (self.spec, self.weights, self.cache, self.token_buf, self.pos_buf, window, self.cos, self.sin, self.tp_group)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                decoder.decode(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = decoder.decode(*args)
        self._graphs[window] = (graph, logits)


class _Run:
    """State of one ``generate`` call (kept out of ``Sampler`` so calls cannot leak state)."""

    def __init__(self, s: Sampler, prompts: list[list[int]], params: SamplingParams, step: int, keys: list[int]):
        self.s, self.params, self.prompts = s, params, prompts
        dev = s.device
        n, self.n = params.n, params.n
        self.num_prompts = len(prompts)
        self.N = N = len(prompts) * n
        self.R = R = params.max_new_tokens
        self.cache: StaticKVCache = s.cache  # type: ignore[assignment]
        self.S = self.cache.num_slots
        self.prompt_lens = [len(p) for p in prompts]
        seq = torch.arange(N, device=dev)
        keys_t = torch.tensor(keys, dtype=torch.int64, device=dev)
        self.seq_key = sequence_keys(params.seed, step, keys_t[seq // n], seq % n)  # [N]
        self.pos_key = position_keys(R, dev)  # [R]
        self.out_ids = torch.full((N, R), s.pad_token_id, dtype=torch.int64, device=dev)
        self.out_logp = torch.zeros((N, R), dtype=torch.float32, device=dev)
        self.out_len = torch.zeros(N, dtype=torch.int64, device=dev)
        self.out_stopped = torch.zeros(N, dtype=torch.bool, device=dev)
        self.stop_ids = torch.tensor(sorted({int(t) for t in params.stop_token_ids}), dtype=torch.int64, device=dev)
        stops = [list(map(int, q)) for q in params.stop_sequences]
        self.stop_len = max((len(q) for q in stops), default=0)
        if stops:  # right-aligned in a [Q, L] table; -2 (never a token) where a stop is shorter
            table = torch.full((len(stops), self.stop_len), -2, dtype=torch.int64)
            for i, q in enumerate(stops):
                table[i, self.stop_len - len(q):] = torch.tensor(q)
            self.stop_table = table.to(dev)
            self.stop_care = self.stop_table >= 0
        self.slots = _Slots(s.token_buf, s.pos_buf, R, not params.greedy, self.stop_len)
        # host mirror of slots.pos without per-step Python work: pos = pos_base + decode_steps
        self.pos_base = [0] * self.S
        self.live = 0  # live slots are [0, live)
        self.next_seq = 0  # sequences [next_seq, N) are waiting
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "prefill_calls": 0,
                      "prefill_tokens": 0, "prefill_padded_tokens": 0, "slot_steps": 0, "compaction_moves": 0}

    # ------------------------------------------------------------------ main loop

    def execute(self) -> RolloutOutput:
        t_start = time.perf_counter()
        threshold = max(1, int(self.s.refill_fraction * self.S))
        while True:
            free, waiting = self.S - self.live, self.N - self.next_seq
            if waiting and free and (self.live == 0 or free >= min(waiting, threshold)):
                self._admit(min(free, waiting))
                continue  # admitted sequences may finish at once (stop on the first token)
            if self.live == 0:
                break  # nothing live and (free == S) nothing waiting
            self._decode_step()
        return self._finish(time.perf_counter() - t_start)

    # ------------------------------------------------------------------ admission

    def _admit(self, m: int) -> None:
        """Prefill the prompts of sequences [next_seq, next_seq + m) into slots [live, live + m)."""
        t0 = time.perf_counter()
        s, dev, n = self.s, self.s.device, self.n
        first, last = self.next_seq, self.next_seq + m
        self.next_seq = last
        seqs = torch.arange(first, last, device=dev)  # [m]
        slot_ids = torch.arange(self.live, self.live + m, device=dev)  # [m]
        prompt_ids = list(range(first // n, (last - 1) // n + 1))  # distinct prompts, consecutive
        # chunk the distinct prompts (sorted by length: similar widths share an attention grid)
        # by a token budget
        order = sorted(prompt_ids, key=lambda i: self.prompt_lens[i])
        chunks: list[list[int]] = [[]]
        used = 0
        for i in order:
            if chunks[-1] and used + self.prompt_lens[i] > s.prefill_tokens:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += self.prompt_lens[i]
        logits = torch.empty((len(prompt_ids), self.s.spec.vocab_size), dtype=torch.float32, device=dev)
        seq_prompt = seqs // n  # [m]
        for chunk in chunks:
            lens = [self.prompt_lens[i] for i in chunk]
            width, total = max(lens), sum(lens)
            lengths = torch.tensor(lens, dtype=torch.int64, device=dev)
            ids = torch.tensor([t for i in chunk for t in self.prompts[i]], dtype=torch.int64, device=dev)
            ends = lengths.cumsum(0)
            row_of = torch.repeat_interleave(torch.arange(len(chunk), device=dev), lengths)  # [Ttot]
            positions = torch.arange(total, device=dev) - (ends - lengths)[row_of]
            grid_index = None if width * len(chunk) == total else row_of * width + positions
            chunk_t = torch.tensor(chunk, dtype=torch.int64, device=dev)
            # slots whose prompt is in this chunk, and the chunk row each one copies
            hit = seq_prompt[:, None] == chunk_t[None, :]  # [m, P]
            sel = hit.any(1).nonzero().squeeze(1)
            rows = hit[sel].int().argmax(1)
            out = decoder.prefill(s.spec, s.weights, self.cache, ids, positions, grid_index, width, ends - 1,
                                  slot_ids[sel], rows, s.cos, s.sin, s.tp_group)
            logits.index_copy_(0, chunk_t - prompt_ids[0], out)
            self.stats["prefill_calls"] += 1
            self.stats["prefill_tokens"] += total
            self.stats["prefill_padded_tokens"] += width * len(chunk)
        sl = self.slots
        a, b = self.live, self.live + m
        plen = torch.tensor([self.prompt_lens[i] for i in range(first // n, (last - 1) // n + 1)], device=dev)
        sl.seq[a:b] = seqs
        sl.gen[a:b] = 0
        # the first sampled token is fed at position len(prompt); the shared update below adds 1
        sl.pos[a:b] = plen[seq_prompt - prompt_ids[0]] - 1
        if sl.u is not None:  # all the uniforms these sequences will use, drawn at once
            sl.u[a:b] = uniforms(self.seq_key[seqs, None], self.pos_key[None, :])
        if sl.window is not None:
            sl.window[a:b] = -1
        steps = self.stats["decode_steps"]
        self.pos_base[a:b] = [self.prompt_lens[q // n] - steps for q in range(first, last)]
        self.live = b
        self.stats["prefill_s"] += time.perf_counter() - t0
        self._sample_and_retire(a, b, logits[seq_prompt - prompt_ids[0]])

    # ------------------------------------------------------------------ decode

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        s, sl, b = self.s, self.slots, self.live
        need = max(self.pos_base[:b]) + self.stats["decode_steps"] + 1  # positions [0, max pos]
        window = min(self.cache.max_seq_len, -(-need // 32) * 32)
        logits = s.decode_logits(b, window)
        self.stats["decode_steps"] += 1  # advances every live slot's host position by one
        self.stats["slot_steps"] += b
        self._sample_and_retire(0, b, logits)
        self.stats["decode_s"] += time.perf_counter() - t0

    def _sample_and_retire(self, a: int, b: int, logits: Tensor) -> None:
        """Sample the next token of live slots [a, b), record it, retire finished sequences."""
        sl, p = self.slots, self.params
        gen, seq = sl.gen[a:b], sl.seq[a:b]
        u = None if sl.u is None else sl.u[a:b].gather(1, gen[:, None]).squeeze(1)
        tok, logp = sample_next(logits, p, u)
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
        done = gen >= self.R if stopped is None else stopped | (gen >= self.R)
        finished = done.nonzero().squeeze(1)
        fin = finished.tolist()  # the one host sync of a step
        if not fin:
            return
        fs = seq[finished]
        self.out_len[fs] = gen[finished]
        if stopped is not None:
            self.out_stopped[fs] = stopped[finished]
        self._compact([a + i for i in fin])

    def _compact(self, dead: list[int]) -> None:
        """Remove finished slots, moving the last live slots into the holes."""
        new_live = self.live - len(dead)
        dead_set = set(dead)
        holes = [i for i in dead if i < new_live]
        movers = [i for i in range(new_live, self.live) if i not in dead_set]
        if holes:
            dev = self.s.device
            src = torch.tensor(movers, dtype=torch.int64, device=dev)
            dst = torch.tensor(holes, dtype=torch.int64, device=dev)
            filled = max(self.pos_base[i] for i in movers) + self.stats["decode_steps"]  # positions < pos
            self.cache.move(movers, holes, filled)
            for t in self.slots.tensors():
                t.index_copy_(0, dst, t.index_select(0, src))
            for h, m in zip(holes, movers):
                self.pos_base[h] = self.pos_base[m]
            self.stats["compaction_moves"] += len(holes)
        self.live = new_live

    # ------------------------------------------------------------------ output

    def _finish(self, total_s: float) -> RolloutOutput:
        N, R = self.N, self.R
        lengths = self.out_len
        mask = torch.arange(R, device=lengths.device)[None, :] < lengths[:, None]
        ids, logp = self.out_ids, self.out_logp  # never written past a sequence's end
        tokens = int(lengths.sum())
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
        }
        return RolloutOutput(
            response_ids=ids,
            response_mask=mask,
            log_probs=logp,
            response_lengths=lengths,
            truncated=~self.out_stopped,
            prompt_index=torch.arange(N, device=lengths.device) // self.n,
            stats=stats,
        )
