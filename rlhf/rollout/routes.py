"""Rollout routing record (R3): the top-k expert ids the sampler used for every token it fed.

Rollout Routing Replay (``actor.router_replay=R3``; verl ``router_replay.mode=R3``, slime
``--use-rollout-routing-replay``) makes the trainer's forwards use the experts the *sampler* chose,
so a router decision that flips between the rollout kernels / precision and the trainer's cannot
change a token's log-prob. The sampler knows each token's routes when it feeds the token: a
prompt token (and a multi-turn observation token, and a recomputed one after preemption) in a
prefill, a generated token in the decode step that feeds it back. The ids are kept per output
row and position, laid out as the trainer's batch (``RolloutBatch.routes``)::

    routes[row, W - prompt_len + pos, s, :]    ids of the token at sequence position pos,
                                               sparse layer s (W: the prompt width of the book)

so a row's prompt is right-aligned to ``W`` columns and its response starts at column ``W``.
``-1`` marks a token no forward routed (padding; the last token of a trajectory, which is
sampled but never fed: it only conditions logits that nothing scores). A later forward of the same
position (a preempted sequence recomputed) overwrites the earlier ids: the K/V the following
tokens attended to came from it. Memory: ``2 * S * k`` bytes per token (int16), e.g. 768 B for
Qwen3-30B-A3B (48 sparse layers, top-8), 1.5 KB for Qwen3-235B-A22B: a replica's 512 rows of 5k
tokens take 3.8 GB, so on a GPU the book lives in host memory. A decode step's ids then leave the
device by a non-blocking copy into pinned memory, applied to the book at the next step (after the
scheduler's one host sync per step has passed, checked by an event): no extra sync per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROUTE_DTYPE = torch.int16  # expert ids < 32768


class RouteBook:
    """``[rows, W + R, S, k]`` int16 routes of one generate call (module docstring)."""

    def __init__(self, rows: int, prompt_width: int, max_new_tokens: int, shape: tuple[int, int],
                 device: torch.device, on_host: bool | None = None) -> None:
        """``device``: the sampler's; ``on_host`` (default: on CUDA) keeps the book in host memory."""
        self.W = prompt_width
        self.staged = device.type == "cuda" if on_host is None else on_host
        home = torch.device("cpu") if self.staged else device
        self.ids = torch.full((rows, prompt_width + max_new_tokens, *shape), -1, dtype=ROUTE_DTYPE, device=home)
        self.base = torch.zeros(rows, dtype=torch.int64, device=device)  # W - prompt length, per row
        self._pending: list[tuple] = []  # staged decode writes: (rows, columns, ids, event) on the host
        self._base: list[int] = [0] * rows  # its host mirror (spans are written from host offsets)

    def start_rows(self, rows: list[int], prompt_len: int, clear: bool = True) -> None:
        """Rows that (re)start with a prompt of ``prompt_len`` tokens (``clear``: their old ids dropped)."""
        if prompt_len > self.W:
            raise ValueError(f"route record: prompt of {prompt_len} tokens past the record's width {self.W}")
        self.flush()
        if clear:
            self.ids.index_fill_(0, torch.tensor(rows, dtype=torch.int64, device=self.ids.device), -1)
        self.base.index_fill_(0, torch.tensor(rows, dtype=torch.int64, device=self.base.device), self.W - prompt_len)
        for r in rows:
            self._base[r] = self.W - prompt_len

    def write_span(self, row: int, start: int, ids: Tensor) -> None:
        """Positions ``[start, start + len(ids))`` of ``row`` took ``ids [len, S, k]`` (a prefill)."""
        self.flush()
        col = self._base[row] + start
        self.ids[row, col:col + ids.shape[0]] = ids.to(ROUTE_DTYPE).to(self.ids.device)

    def write_steps(self, rows: Tensor, pos: Tensor, ids: Tensor) -> None:
        """Decode step: ``rows [b]`` fed the token at position ``pos [b]``, routed to ``ids [b, S, k]``."""
        cols, ids = self.base[rows] + pos, ids.to(ROUTE_DTYPE)
        if not self.staged:
            self.ids.index_put_((rows, cols), ids)
            return
        self.flush()  # the previous step's copies (a host sync has passed since)
        copies = [t.to("cpu", non_blocking=True, copy=True) for t in (rows, cols, ids)]  # pinned on CUDA
        event = torch.cuda.Event() if ids.is_cuda else None
        if event is not None:
            event.record()
        self._pending.append((*copies, event))

    def flush(self) -> None:
        """Apply the staged decode writes (waits for their copies)."""
        for rows, cols, ids, event in self._pending:
            if event is not None:
                event.synchronize()
            self.ids.index_put_((rows, cols), ids)
        self._pending = []

    def table(self) -> Tensor:
        """The whole book ``[rows, W + R, S, k]``, every write applied."""
        self.flush()
        return self.ids


def stack_routes(routes: list | None) -> Tensor | None:
    """A forward's per-sparse-layer ids (``rlhf.models.decoder``, ``[T, k]`` each) -> ``[T, S, k]``."""
    return torch.stack(routes, dim=1) if routes else None


def batch_routes(routes: Tensor, width: int, prompt_width: int) -> Tensor:
    """``[N, W + R, S, k]`` (prompts right-aligned to ``width`` W) -> ``[N, P + R, S, k]`` for prompts of
    ``prompt_width`` P: left-padded with -1, or its first ``W - P`` columns dropped (prompts cut to their
    last P tokens, as ``RolloutEngine.to_batch`` cuts them)."""
    if width >= prompt_width:
        return routes[:, width - prompt_width:]
    pad = routes.new_full((routes.shape[0], prompt_width - width, *routes.shape[2:]), -1)
    return torch.cat([pad, routes], dim=1)
