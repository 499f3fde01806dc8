"""Lossless speculative decoding without a draft model: n-gram drafts verified in one forward.

Each decode step, every live sequence gets up to ``K`` draft tokens by n-gram lookup in what the
sampler already holds (``rlhf.rollout.drafts``: the other samples of its prompt, its own prompt and
tokens). One forward of the target model (``rlhf.models.verify_forward``) feeds the last sampled
token and the drafts, ``K + 1`` query tokens per sequence, and gives the target's logits at each
of the ``K + 1`` positions. Sequences without a draft run the plain decode step (nothing changes).

Acceptance (``verify_tokens``). Column ``j`` holds the logits after the prefix ``x_<t`` plus drafts
``d_0 .. d_{j-1}``; it is sampled exactly as plain decoding would sample position ``t + j``:
``y_j = sample_next(logits_j, params, u[t + j])`` (temperature, top-k, top-p, min-p applied to the
target's distribution ``p_j`` first; the uniform is the one keyed by the position). Draft ``d_j``
is accepted iff ``y_j == d_j``, and the emitted tokens are ``y_0 .. y_m``, ``m`` the first
rejection (or ``K``). With a deterministic draft (``q = one-hot(d)``) this is the speculative
sampling rule of Leviathan et al. 2023 / Chen et al. 2023 realised by coupling one uniform:

* ``P(accept d) = P(y = d) = p(d) = min(1, p(d) / q(d))``;
* given a rejection, ``y`` is distributed as ``p`` restricted to tokens ``!= d`` and renormalised,
  which is ``norm(max(p - q, 0))`` for ``q = one-hot(d)``;
* after ``K`` acceptances the bonus token ``y_K`` is a plain draw from ``p_K``.

So the output distribution is the target's, and more: the emitted tokens are the very tokens plain
decoding draws with the same keyed uniforms (identical up to the logits' fp rounding in the wider
forward), greedy included (accept iff argmax equals the draft). Log-probs come from the target's
logits of the emitted column (``sample_next``'s). Rejected drafts' K/V are junk past the sequence's
length in its own blocks (or the scratch block); the next pass overwrites them before any query
reads them.

Cache: the blocks for a sequence's drafted positions are taken from the free list only if free;
under pressure the draft shrinks to the blocks the sequence owns (speculation never preempts).

Not applied (plain decode runs) with CUDA graphs (static decode shapes) and vision-language models
(their rotary positions). The verify forward computes each sequence's own drafted tokens only.
Sampled at temperature 1 on the CPU quickstarts it does not pay yet (docs/benchmarks.md): off by default.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import Tensor

from rlhf.models.verify_forward import verify
from rlhf.rollout.drafts import ngram_drafts
from rlhf.rollout.sampling import SamplingParams, sample_next

# Counts a run reports (summed over rollout replicas); the rates are derived from them.
SPEC_STATS = ("spec_drafted", "spec_accepted", "spec_forwards", "spec_decode_tokens", "spec_slot_steps")


def verify_tokens(logits: Tensor, drafts: Tensor, params: SamplingParams, u: Optional[Tensor],
                  valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative acceptance of deterministic drafts (see the module docstring for the rule).

    Args:
        logits: ``[B, K + 1, V]`` float32, the target's logits at each drafted position (column
            ``j``: after the drafts ``< j``); with ``valid``, ``[T, V]``: only the valid columns'.
        drafts: ``[B, K]`` int64 draft tokens; -1 (never sampled) ends a shorter draft.
        params: the sampling settings (greedy when ``temperature == 0``).
        u: ``[B, K + 1]`` float32 uniforms in (0, 1] of the positions (None for greedy).
        valid: ``[B, K + 1]`` bool, the columns that were computed (each row's draft + 1).
    Returns:
        ``tokens`` ``[B, K + 1]`` the target's draw at each column (-2 off ``valid``), ``log_probs``
        ``[B, K + 1]`` (``sample_next``'s: the temperature-scaled, untruncated log-probs) and
        ``emitted`` ``[B]`` in ``[1, K + 1]``: the tokens ``tokens[:, :emitted]`` are the output
        (accepted drafts, then the correction or bonus token).
    """
    b, c = drafts.shape[0], drafts.shape[1] + 1
    if valid is None:
        valid = torch.ones((b, c), dtype=torch.bool, device=drafts.device)
        logits = logits.reshape(b * c, -1)
    uv = None if u is None else u[valid]
    tok_v, logp_v = sample_next(logits, params, uv)
    tok = torch.full((b, c), -2, dtype=torch.int64, device=drafts.device).masked_scatter_(valid, tok_v)
    logp = torch.zeros((b, c), dtype=logp_v.dtype, device=drafts.device).masked_scatter_(valid, logp_v)
    accepted = (tok[:, :-1] == drafts).long().cumprod(dim=1).sum(dim=1)  # leading matches
    return tok, logp, accepted + 1


def for_run(run: Any) -> Optional["Speculator"]:
    """The run's speculator when ``rollout.speculative`` is on and applies (see module docstring)."""
    cfg = getattr(run.s, "speculative", None)
    if cfg is None or not cfg.enable or run.s.static_shapes or run.vision is not None:
        return None
    return Speculator(run, cfg)


class Speculator:
    """The speculative decode step of one ``GenerateRun`` (``rlhf.rollout.scheduler``)."""

    def __init__(self, run: Any, cfg: Any) -> None:
        self.run, self.k = run, int(cfg.num_draft_tokens)
        self.sizes = list(range(int(cfg.ngram_min), int(cfg.ngram_max) + 1))
        self.siblings, self.own = "siblings" in cfg.sources, "self" in cfg.sources
        dev = run.s.device
        self.pm = max(run.prompt_lens)
        prompts = torch.full((len(run.prompts), self.pm), -1, dtype=torch.int64)
        for i, p in enumerate(run.prompts):  # right-aligned: a response starts at column pm
            prompts[i, self.pm - len(p):] = torch.tensor(p, dtype=torch.int64)
        self.prompts = prompts.to(dev)
        self.written = torch.zeros(run.N, dtype=torch.int64, device=dev)  # response tokens of each row seen
        self.counts = dict.fromkeys(SPEC_STATS, 0)

    # ------------------------------------------------------------------ drafting

    def _draft(self, seq: Tensor, gen: Tensor) -> tuple[Tensor, Tensor]:
        """Drafts ``[B, K]`` and their lengths ``[B]`` of the live sequences ``seq`` (``gen`` tokens each)."""
        run, pm = self.run, self.pm
        dev, n, width = seq.device, run.n, self.max_ngram
        self.written[seq] = gen
        prompt = seq // n
        own = torch.cat((self.prompts[prompt], run.out_ids[seq]), dim=1)  # [B, pm + R]
        cols = pm + gen[:, None] - width + torch.arange(width, device=dev)  # the last `width` tokens
        context = own.gather(1, cols.clamp(min=0)).masked_fill_(cols < 0, -1)
        rows = prompt[:, None] * n + torch.arange(n, device=dev) if self.siblings else seq[:, None]  # [B, M]
        known = pm + self.written[rows]
        if not self.own:
            known = known.masked_fill(rows == seq[:, None], 0)
        corpus = torch.cat((self.prompts[prompt][:, None].expand(-1, rows.shape[1], -1), run.out_ids[rows]), dim=2)
        return ngram_drafts(context, corpus, known, self.sizes, self.k)

    @property
    def max_ngram(self) -> int:
        return self.sizes[-1]

    def _reserve(self, klen: list[int]) -> list[int]:
        """Blocks for each slot's drafted positions where free ones exist; else the draft is cut to the
        positions the slot already owns."""
        run, cache = self.run, self.run.cache
        steps = run.stats["decode_steps"]
        for i, k in enumerate(klen):
            if not k:
                continue
            pos = run.pos_base[i] + steps  # the position of the slot's next input token
            extra = cache.extra_blocks(i, pos + 1 + k)
            if extra > cache.num_free:
                klen[i] = max(0, min(k, len(cache.owned[i]) * cache.block_size - pos - 1))
            elif extra:
                cache.grow([i], [pos + 1 + k])
        return klen

    # ------------------------------------------------------------------ the step

    def decode_step(self) -> bool:
        """One speculative decode step of the live slots; False (nothing done) when no slot has a draft."""
        t0 = time.perf_counter()
        run, s = self.run, self.run.s
        b, sl, R, params = run.live, run.slots, run.R, run.params
        gen, seq = sl.gen[:b], sl.seq[:b]
        drafts, dlen = self._draft(seq, gen)
        klen = torch.minimum(dlen, (R - 1 - gen).clamp(min=0)).tolist()
        klen = self._reserve(klen) if any(klen) else klen
        k = max(klen)
        if k == 0:  # the plain step runs: one token per slot
            self.counts["spec_decode_tokens"] += b
            self.counts["spec_slot_steps"] += b
            return False
        dev = seq.device
        steps_k = torch.arange(k + 1, device=dev)
        valid = steps_k < torch.tensor(klen, device=dev)[:, None] + 1  # [B, K + 1]: the token, then the draft
        drafts = torch.where(valid[:, 1:], drafts[:, :k], -1)
        tokens = torch.cat((sl.token[:b, None], drafts.clamp(min=0)), dim=1)  # [B, K + 1]
        pos = (sl.pos[:b, None] + steps_k).clamp(max=s.max_seq_len - 1)
        window = min(s.max_seq_len, max(p + q for p, q in zip(run.pos_base[:b], klen)) + run.stats["decode_steps"] + 1)
        logits = verify(s.spec, s.weights, run.cache, tokens, pos, valid, window, s.cos, s.sin, s.tp_group)
        cols = gen[:, None] + steps_k  # response positions of the columns
        u = None if sl.u is None else sl.u[:b].gather(1, cols.clamp(max=R - 1))
        tok, logp, emitted = verify_tokens(logits, drafts, params, u, valid)
        emitted = torch.minimum(emitted, R - gen)
        stopped = self._stops(tok, emitted, b)
        emitted = torch.where(stopped.any(1), stopped.int().argmax(1) + 1, emitted)  # up to the first stop
        keep = steps_k < emitted[:, None]  # [B, K + 1]
        index = (seq[:, None].expand_as(cols)[keep], cols[keep])
        run.out_ids.index_put_(index, tok[keep])
        run.out_logp.index_put_(index, logp[keep])
        self._advance_window(tok, emitted, b)
        sl.token[:b] = tok.gather(1, (emitted - 1)[:, None]).squeeze(1)
        sl.pos[:b] += emitted
        gen += emitted  # in place on the slot state
        stopped = (stopped & keep).any(1)
        finished = (stopped | (gen >= R)).nonzero().squeeze(1)
        host = torch.cat((emitted, finished)).tolist()  # the one host sync after the forward
        for i, e in enumerate(host[:b]):
            run.pos_base[i] += e - 1  # the host position is pos_base + decode_steps
        run.stats["decode_steps"] += 1
        run.stats["slot_steps"] += b
        run._grow_at = 0  # slots moved by different amounts: recheck their blocks next step
        c = self.counts
        c["spec_drafted"] += sum(klen)
        c["spec_accepted"] += sum(host[:b]) - b
        c["spec_forwards"] += 1
        c["spec_decode_tokens"] += sum(host[:b])
        c["spec_slot_steps"] += b
        run._retire(0, seq, gen, stopped, finished, host[b:])
        run.stats["decode_s"] += time.perf_counter() - t0
        return True

    def _stops(self, tok: Tensor, emitted: Tensor, b: int) -> Tensor:
        """``[B, K + 1]``: the emitted columns that end the sequence (a stop token, or a stop sequence
        completed there)."""
        run, sl = self.run, self.run.slots
        stop = torch.isin(tok, run.stop_ids) if run.stop_ids.numel() else torch.zeros_like(tok, dtype=torch.bool)
        if sl.window is not None:  # windows of the last stop_len tokens ending at each column
            trail = torch.cat((sl.window[:b], tok), dim=1).unfold(1, run.stop_len, 1)[:, 1:]  # [B, K+1, L]
            hit = ((trail[:, :, None, :] == run.stop_table) | ~run.stop_care).all(-1).any(-1)
            stop = stop | hit
        return stop & (torch.arange(tok.shape[1], device=tok.device) < emitted[:, None])

    def _advance_window(self, tok: Tensor, emitted: Tensor, b: int) -> None:
        """The stop window takes the emitted tokens (it keeps the last ``stop_len``)."""
        sl = self.run.slots
        if sl.window is None:
            return
        trail = torch.cat((sl.window[:b], tok), dim=1)  # [B, L + K + 1]
        idx = emitted[:, None] + torch.arange(self.run.stop_len, device=tok.device)
        sl.window[:b] = trail.gather(1, idx)

    def stats(self) -> dict[str, float]:
        out = {key: float(v) for key, v in self.counts.items()}
        return {**out, **derived_stats(out)}


def derived_stats(stats: dict[str, float]) -> dict[str, float]:
    """``spec_acceptance_rate`` (accepted / drafted tokens) and ``spec_tokens_per_forward`` (tokens a
    sequence gains per decode forward; 1 without speculation) from the summed counts."""
    return {"spec_acceptance_rate": stats["spec_accepted"] / max(stats["spec_drafted"], 1.0),
            "spec_tokens_per_forward": stats["spec_decode_tokens"] / max(stats["spec_slot_steps"], 1.0)}
