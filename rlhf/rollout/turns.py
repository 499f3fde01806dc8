"""Multi-turn seam of the sampler: a sequence whose assistant turn ended waits for an observation.

The agent layer implements ``TurnHandler``; ``Sampler.generate(..., turns=handler)`` asks it,
each time a sequence stops below ``max_new_tokens``, whether the sequence waits for an
observation (a tool response). A waiting sequence is *parked*: it leaves its decode slot
(others decode meanwhile) but keeps its KV blocks. When the handler hands over the
observation's token ids they are prefilled onto the same sequence (its cached K/V reused,
positions continuing) and decoding resumes from the logits after the last observation token.

One trajectory is one output row: ``response_ids`` hold generated and observation tokens in
order, ``response_mask`` is False on observation tokens (a mask with holes), ``log_probs`` are
0 there, and ``max_new_tokens`` bounds the whole trajectory (verl's ``response_length`` rule:
an observation longer than the room left is cut; with no room left the row is truncated).

Draws stay keyed by (seed, step, prompt key, sample, response position), so the tokens do
not depend on when a tool answers, on preemption of a parked sequence (its blocks freed, the
trajectory recomputed on resume) or on the layout. Under a tensor-parallel rollout the TP
peers schedule in lockstep: the handler must return identical results, in identical order,
on every peer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol


class TurnHandler(Protocol):
    def turn_ended(self, row: int, response: list[int]) -> bool:
        """Output row ``row``'s assistant turn just ended: its last token is a stop token or
        completes a stop sequence, and it is below max_new_tokens. ``response`` holds all the
        row's response tokens so far (generated tokens and earlier observations, ending with
        the stop token/sequence). Return True when the sequence waits for an observation
        (the sampler parks it, KEEPING its KV blocks, and decodes the others meanwhile);
        False: the sequence is finished as usual (on_finished is called then)."""
        ...

    def poll(self, wait: bool) -> list[tuple[int, list[int]]]:
        """Observations ready to append, as (row, token ids). ``wait=True`` (the sampler has
        no live sequence to decode) blocks until at least one parked row's observation is
        ready. Every parked row eventually gets exactly one observation."""
        ...


@dataclass
class Parked:
    """A sequence waiting for (or holding, not yet resumed) its observation."""

    blocks: list[int] | None  # its KV blocks; None once preempted (recomputed on resume)
    length: int  # trajectory length at the turn end, the stop token included (not yet cached)
    order: int  # admission number: preemption takes the latest first
    observation: list[int] | None = None  # token ids, already cut to the room left


class ParkingLot:
    """The parked sequences of one ``generate`` call and the handler's observations for them.

    ``ready`` lists, in arrival order, the parked rows whose observation came and that wait
    for a decode slot to resume in.
    """

    def __init__(self, handler: TurnHandler, vocab_size: int, max_new_tokens: int) -> None:
        self.handler = handler
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.parked: dict[int, Parked] = {}
        self.ready: deque[int] = deque()

    def park(self, row: int, blocks: list[int], length: int, order: int) -> None:
        self.parked[row] = Parked(blocks, length, order)

    def poll(self, wait: bool) -> list[tuple[int, list[int]]]:
        """The handler's new observations, checked and cut to the room left in each trajectory."""
        got = self.handler.poll(wait)
        if wait and not got:
            raise RuntimeError(f"TurnHandler.poll(wait=True) returned no observation while {len(self.parked)} "
                               "rows wait for one and nothing else can run")
        out = []
        for row, ids in got:
            p = self.parked.get(row)
            if p is None or p.observation is not None:
                raise ValueError(f"TurnHandler.poll returned an observation for row {row}, which is not waiting "
                                 "for one (each parked row gets exactly one observation per turn)")
            ids = [int(t) for t in ids]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"observation of row {row} holds token id {bad[0]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            ids = ids[: self.max_new_tokens - p.length]
            p.observation = ids
            out.append((row, ids))
        return out

    def holding_blocks(self) -> list[int]:
        """Parked rows that still hold KV blocks, the latest admitted first (preemption order)."""
        rows = [q for q, p in self.parked.items() if p.blocks is not None]
        return sorted(rows, key=lambda q: -self.parked[q].order)
