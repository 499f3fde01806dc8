"""The multi-turn steps of one ``Sampler.generate`` call (``rlhf.rollout.scheduler.GenerateRun``):
park a sequence whose turn ended, write the observation the handler returns into its trajectory, and
resume it by prefilling ``[stop token] + observation`` onto its cached K/V (``rlhf.rollout.turns``)."""

from __future__ import annotations

import time

import torch


class TurnSteps:
    """Mixed into ``GenerateRun``, whose state (``lot``, ``cache``, ``out_ids``, slots, stats) these use."""

    def _take_observations(self, wait: bool) -> None:
        """Poll the handler; write each observation into its trajectory (a hole of the mask)."""
        lot, R = self.lot, self.R
        for q, obs in lot.poll(wait):
            p = lot.parked[q]
            end = p.length + len(obs)
            if obs:
                self.out_ids[q, p.length:end] = torch.tensor(obs, dtype=torch.int64, device=self.s.device)
                self.out_obs[q, p.length:end] = True
            self.stats["turns"] += 1
            self.stats["observation_tokens"] += len(obs)
            if end < R:
                lot.ready.append(q)
                continue
            del lot.parked[q]  # no room left to generate: the trajectory ends truncated
            if p.blocks is not None:
                self.cache.free_blocks(p.blocks)
            row = torch.tensor([q], dtype=torch.int64, device=self.s.device)
            self._finish_rows(row, torch.full_like(row, R), torch.zeros_like(row, dtype=torch.bool))

    def _resume(self) -> None:
        """Resume ready parked sequences in free slots: prefill ``[stop token] + observation`` onto
        their cached K/V. One whose blocks were freed (or that finds no blocks) is requeued."""
        t0 = time.perf_counter()
        lot, cache = self.lot, self.cache
        a = self.live
        seqs, gens, orders, logits = [], [], [], []
        while lot.ready and a + len(seqs) < self.S:
            q = lot.ready.popleft()
            p = lot.parked.pop(q)
            g = p.length + len(p.observation)
            self.turn_start[q] = g
            length = self.prompt_lens[q // self.n] + g  # the positions to be cached
            if p.blocks is not None:
                need = cache.blocks_for(length + 1) - len(p.blocks)
                self._evict_parked(need)
                if need > cache.num_free:
                    self._drop_parked(p)
                    self.stats["parked_preemptions"] += 1
            if p.blocks is None:  # recompute prompt + trajectory when re-admitted
                self.resume_gen[q] = g
                self.queue.appendleft(q)
                continue
            slot = a + len(seqs)
            cache.attach(slot, p.blocks)
            cache.grow([slot], [length + 1])
            last = self.out_ids[q, p.length - 1:g].tolist()  # the stop token is not cached yet
            slot_t = torch.tensor([slot], dtype=torch.int64, device=self.s.device)
            # a VLM's tool turn continues on text positions: cache position + the prompt's M-RoPE delta
            shift = 0 if self.vision is None else self.vision.prompts[q // self.n].delta  # host copy: no sync
            logits.append(self._extend(last, length - len(last), slot_t, seqs=[q], rope_shift=shift))
            self.stats["prefill_tokens"] += len(last)
            seqs.append(q), gens.append(g), orders.append(p.order)
        if seqs:
            self._place(seqs, gens, orders)
        self.stats["prefill_s"] += time.perf_counter() - t0
        if seqs:
            self._sample_and_retire(a, self.live, torch.cat(logits))

    def _evict_parked(self, need: int) -> bool:
        """Free the blocks of parked sequences (latest admitted first) until ``need`` blocks are
        free; False when the parked ones cannot provide them."""
        if self.lot is None:
            return False
        for q in self.lot.holding_blocks():
            if self.cache.num_free >= need:
                break
            self._drop_parked(self.lot.parked[q])
            self.stats["parked_preemptions"] += 1
        return self.cache.num_free >= need

    def _drop_parked(self, p) -> None:
        """A parked sequence gives its cache blocks back; it is prefilled again (prompt + trajectory) when
        it resumes."""
        self.cache.free_blocks(p.blocks)
        p.blocks = None

    def _end_turns(self, slots: list[int], rows: list[int], lens: list[int], stopped: list[bool]) -> list[int]:
        """Ask the handler about each stopped sequence below max_new_tokens; park the ones that
        wait for an observation (blocks detached from the slot). Returns the indices that finish."""
        ids = self.out_ids[torch.tensor(rows, device=self.out_ids.device)].tolist()
        keep = []
        for j, (slot, q, n, st) in enumerate(zip(slots, rows, lens, stopped)):
            if st and n < self.R and self.lot.handler.turn_ended(q, ids[j][:n]):
                self.lot.park(q, self.cache.detach(slot), n, self.slot_order[slot])
            else:
                keep.append(j)
        return keep
