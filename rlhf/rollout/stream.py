"""Continuous generation for trainer.mode fully_async: a sampler run fed and drained while it decodes.

A :class:`StreamRun` is a :class:`~rlhf.rollout.scheduler.GenerateRun` whose prompts are not
fixed at the start. It owns ``groups`` group slots (output rows ``[g*n, (g+1)*n)``); between
decode steps (token boundaries) it asks its driver

* for new weights (``poll_weights``): with ``partial_rollout`` they load at once, in place,
  and the sequences in flight continue: ``kv="recompute"`` preempts every live sequence so
  that ``prompt + generated`` is prefilled again under the new weights (AReaL's default; the
  scheduler's preemption path), ``kv="keep"`` decodes on from the cache the old weights wrote
  (PipelineRL). Without ``partial_rollout`` the new weights wait until the sequences in
  flight finish, and no prompt is admitted meanwhile;
* for new prompts as group slots free up (``next_prompts``: the driver applies admission control);

and hands every finished group (all ``n`` samples of a prompt) to ``on_group`` at once.

Multi-turn (``turns``, a :class:`~rlhf.rollout.turns.TurnHandler` over the slots' rows, e.g.
``rlhf.agent.stream_loop.StreamAgentLoop``): a trajectory whose turn ended parks (as in
``GenerateRun``) while the others decode; its observation is written into its row (a hole of the
mask, version 0, log-prob 0) and it resumes. A weight load with ``recompute`` also frees the
blocks of parked trajectories, so each resumes by prefilling ``prompt + trajectory`` under the
new weights; with ``keep`` they resume on the cache the old weights wrote. Without
``partial_rollout`` new weights also wait for the parked ones. A handler with ``begin_group(g,
key, info)`` / ``end_group(g)`` hears of slot ``g`` starting a prompt and finishing its group; what
``end_group`` returns goes to ``on_group`` as ``out["tools"]``.

Each response token records the policy version that sampled it (``versions``, [n, R]) and its
log-prob under those weights. Draws stay keyed by (seed, step, prompt key, sample, position), so
a pause changes no token unless the weights changed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from rlhf.rollout.sampling import SamplingParams, sequence_keys
from rlhf.rollout.routes import RouteBook
from rlhf.rollout.scheduler import GenerateRun
from rlhf.rollout.vision import VisionPrompts
from rlhf.rollout.turns import TurnHandler

STOP = "stop"  # poll_weights' answer when the run must end


@dataclass
class StreamPrompt:
    """One prompt to generate ``n`` samples of: its tokens, dataset key, the step its draws are
    keyed by, the driver's tag (e.g. its position in the data order) and a VLM prompt's images
    (``{"pixel_values", "image_grid_thw"}``, as ``Sampler.generate``'s ``multi_modal`` entries)."""

    ids: list[int]
    key: int
    step: int
    tag: Any = None
    multi_modal: Optional[dict] = None
    info: Any = None  # the prompt's extra_info (per-sample tool kwargs), for the turn handler


class StreamDriver(Protocol):
    def poll_weights(self, block: bool) -> Any:
        """``(version, weights)`` when new weights arrived, ``STOP`` to end, else None
        (``block``: wait until one of the first two)."""

    def next_prompts(self, free: int, version: int) -> list[StreamPrompt]:
        """At most ``free`` prompts the run may start now, holding weights ``version``."""

    def on_group(self, prompt: StreamPrompt, out: dict[str, torch.Tensor]) -> None:
        """A finished group: ``response_ids`` / ``log_probs`` / ``versions`` [n, R], ``lengths`` /
        ``truncated`` [n] (host tensors); ``routes`` [n, W + R, S, k] when the sampler records them;
        multi-turn: ``observation`` [n, R] (True on observation tokens) and ``tools`` (``end_group``'s)."""


class StreamRun(GenerateRun):
    """See the module docstring. ``sampler`` must already hold ``version``'s weights."""

    aligns_prompts = False  # prompts arrive later: no aligned slot regions (rlhf.rollout.region_cascade)

    def __init__(self, sampler: Any, params: SamplingParams, groups: int, driver: StreamDriver, *,
                 max_prompt_len: int, partial_rollout: bool = True, kv: str = "recompute", version: int = 0,
                 turns: Optional[TurnHandler] = None):
        if kv not in ("recompute", "keep"):
            raise ValueError(f"async_training.partial_rollout_kv must be recompute or keep, got {kv!r}")
        sampler._ensure_capacity(max_prompt_len + params.max_new_tokens)
        # a VLM's group slots hold their prompts' image features and M-RoPE rows (set as prompts arrive)
        vis = VisionPrompts(sampler, [[0]] * groups, [None] * groups) if getattr(sampler, "vlm_config", None) else None
        super().__init__(sampler, [[0]] * groups, params, 0, [0] * groups, vision=vis, turns=turns)
        self.queue.clear()
        self.driver, self.partial, self.kv, self.version = driver, partial_rollout, kv, version
        self.free_groups: deque[int] = deque(range(groups))
        self.group_of: dict[int, StreamPrompt] = {}
        self.rows_done = [0] * groups
        self.out_ver = torch.zeros_like(self.out_ids)  # [groups*n, R] version of each sampled token
        if self.routes is not None:  # prompts come later: the book is as wide as the longest allowed
            self.routes = RouteBook(groups * self.n, max_prompt_len, self.R, sampler.route_shape, sampler.device)
        self.pending: Optional[tuple[int, Any]] = None  # weights waiting for the in-flight ones (no partial)
        self.counts = {"pauses": 0, "paused_sequences": 0, "weight_loads": 0, "groups": 0}

    # ------------------------------------------------------------------ main loop

    @torch.no_grad()  # as Sampler.generate: the vision tower is an nn.Module whose outputs would track grads
    def execute(self) -> dict:
        t0 = time.perf_counter()
        lot = self.lot
        while True:
            if not self._sync(block=False):
                break
            self._refill()
            if lot is not None and lot.parked:
                self._take_observations(wait=False)
                if lot.ready and self.live < self.S:
                    self._resume()
                    continue
            free, waiting = self.S - self.live, len(self.queue)
            if waiting and free:
                admit = self._fitting(free)
                if admit:
                    self._admit(admit)
                    continue
            if self.live == 0:
                if lot is not None and lot.parked:  # everything waits for tools
                    self._take_observations(wait=True)
                    continue
                if not self._sync(block=True):  # idle: admission waits for newer weights
                    break
                continue
            self._reserve_next_positions()
            self._decode_step()
        stats = self._finish(time.perf_counter() - t0)["stats"]
        return {**stats, **{k: float(v) for k, v in self.counts.items()}}

    def _sync(self, block: bool) -> bool:
        """Take new weights at this token boundary; False when the driver says stop."""
        msg = self.driver.poll_weights(block and self.pending is None)
        if msg == STOP:
            return False
        if msg is not None:
            self.pending = msg  # a newer push supersedes one still waiting
        if self.pending is not None and (self.partial or (self.live == 0 and not self.queue and not self._parked())):
            self._load(*self.pending)
            self.pending = None
        return True

    def _parked(self) -> int:
        return 0 if self.lot is None else len(self.lot.parked)

    def _load(self, version: int, weights: Any) -> None:
        in_flight = self.live + self._parked()
        if in_flight and self.kv == "recompute":
            # The latest slot first, so no slot moves and the queue keeps the admission order.
            for slot in range(self.live - 1, -1, -1):
                self._preempt(slot)
            for q in ([] if self.lot is None else self.lot.holding_blocks()):  # re-prefilled when they resume
                self._drop_parked(self.lot.parked[q])
        self.s.load_weights(weights, consume=True)
        if self.vision is not None:  # the prompts in flight are prefilled again with the new tower's features
            self.vision.refresh(sorted(self.group_of))
        self.version = version
        self.counts["weight_loads"] += 1
        if in_flight:
            self.counts["pauses"] += 1
            self.counts["paused_sequences"] += in_flight

    def _refill(self) -> None:
        if not self.free_groups or (self.pending is not None and not self.partial):
            return
        added = [(self.free_groups.popleft(), p) for p in self.driver.next_prompts(len(self.free_groups), self.version)]
        for g, p in added:
            self._add(g, p)
        if self.vision is not None and added:  # one tower forward for the new prompts' images
            self.vision.set([g for g, _ in added], [p.ids for _, p in added], [p.multi_modal for _, p in added])

    def _add(self, g: int, p: StreamPrompt) -> None:
        n, dev = self.n, self.s.device
        rows = slice(g * n, (g + 1) * n)
        self.prompts[g], self.prompt_lens[g] = list(p.ids), len(p.ids)
        self.seq_key[rows] = sequence_keys(self.params.seed, p.step, torch.full((n,), p.key, device=dev),
                                           torch.arange(n, device=dev))
        self.out_ids[rows] = self.s.pad_token_id
        self.out_logp[rows] = 0
        self.out_ver[rows] = 0
        self.out_len[rows] = 0
        self.out_stopped[rows] = False
        if self.out_obs is not None:
            self.out_obs[rows] = False
            if hasattr(self.lot.handler, "begin_group"):
                self.lot.handler.begin_group(g, p.key, p.info)
        if self.routes is not None:
            self.routes.start_rows(list(range(g * n, (g + 1) * n)), len(p.ids))
        for q in range(g * n, (g + 1) * n):
            self.resume_gen[q] = self.turn_start[q] = 0
        self.rows_done[g] = 0
        self.group_of[g] = p
        self.queue.extend(range(g * n, (g + 1) * n))

    # ------------------------------------------------------------------ per token / per finished row

    def _sample_and_retire(self, a: int, b: int, logits: torch.Tensor) -> None:
        sl = self.slots
        self.out_ver.index_put_((sl.seq[a:b], sl.gen[a:b]),
                                torch.tensor(self.version, dtype=self.out_ver.dtype, device=self.out_ver.device))
        super()._sample_and_retire(a, b, logits)

    def _finish_rows(self, rows: torch.Tensor, lens: torch.Tensor, stopped: torch.Tensor) -> None:
        super()._finish_rows(rows, lens, stopped)
        for q in rows.tolist():
            g = q // self.n
            self.rows_done[g] += 1
            if self.rows_done[g] == self.n:
                self._emit(g)

    def _emit(self, g: int) -> None:
        rows = slice(g * self.n, (g + 1) * self.n)
        # copies: the group slot's rows are reused by the next prompt (.to(cpu) alone is a view on CPU)
        out = {"response_ids": self.out_ids[rows], "log_probs": self.out_logp[rows], "versions": self.out_ver[rows],
               "lengths": self.out_len[rows], "truncated": ~self.out_stopped[rows]}
        if self.routes is not None:
            out["routes"] = self.routes.table()[rows]
        if self.out_obs is not None:
            out["observation"] = self.out_obs[rows]
        out = {k: v.to("cpu", copy=True) for k, v in out.items()}
        if self.lot is not None and hasattr(self.lot.handler, "end_group"):
            out["tools"] = self.lot.handler.end_group(g)
        p = self.group_of.pop(g)
        self.free_groups.append(g)
        self.counts["groups"] += 1
        self.driver.on_group(p, out)
