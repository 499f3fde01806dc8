"""Over-sampling's early stop inside one ``Sampler.generate`` call (``rollout.over_sample_rate``).

verl's rule (its SGLang rollout, ``over_sample_rate``): once ``(1 - rate)`` of the started
requests have completed, the remaining ones are aborted. Here the unit is a prompt *group*
(its ``n`` samples): a group counts as done when all its samples finished, and at the abort
every sample of an unfinished group is dropped, finished or not. A group with some samples
missing would bias its GRPO baseline, and a prompt partly trained cannot go back to the data
order without being trained twice; verl instead keeps aborted requests as zero-mask padding
rows and loses their prompts.

:class:`EarlyStop` counts finished groups; when ``keep_groups`` are done the run calls
:meth:`EarlyStop.stop`, which frees every KV block still held (live slots and parked
multi-turn sequences), empties the queue and tells a multi-turn handler to forget the rows
whose tool calls are still out. Under a tensor-parallel rollout every peer finishes the same
rows at the same steps, so all peers stop at the same step.

The count is global over the rollout replicas (``group``: one rank per replica): verl's rule
counts per rollout worker, but with a few groups per replica a per-replica share rounds to
"all of them" on some replicas and cuts nothing there, while the step still waits for the
slowest replica. So the replicas all-reduce their finished counts, one small asynchronous
all-reduce at a time, checked (not waited for) once per scheduler iteration; a replica whose
own groups are all done keeps taking part until the total is reached, and all replicas stop
after the same round. The abort lands one round after the count is reached: groups finished
meanwhile are extra (given back by the trainer), never too few. Under a tensor-parallel rollout
each round is waited for (``lockstep``): the peers of a replica see it complete at the same
iteration and stop together.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["EarlyStop", "estimated_saved_s"]


def estimated_saved_s(finished_lens: list[int], aborted_gen: list[int], max_new_tokens: int,
                      step_s: float) -> float:
    """Decode time the aborted sequences would still have cost, estimated from the finished ones.

    Each aborted sequence that has generated ``g`` tokens is expected to end at the mean length of
    the finished sequences longer than ``g`` (``max_new_tokens`` when none is); the replica would
    have decoded until the last of them ended, at ``step_s`` seconds per decode step.

    Args:
        finished_lens: response lengths of the sequences that finished in this call.
        aborted_gen: tokens generated so far by each aborted sequence (0: never admitted).
        max_new_tokens: the length cap.
        step_s: mean seconds of one decode step of this call.

    Returns:
        ``step_s * max_g(expected_end(g) - g)``; 0 without aborted sequences.
    """
    if not aborted_gen:
        return 0.0
    lens = torch.tensor(sorted(finished_lens) or [max_new_tokens], dtype=torch.float64)
    gen = torch.tensor(aborted_gen, dtype=torch.float64)
    longer = lens[None, :] > gen[:, None]  # [A, F]
    count = longer.sum(1)
    mean = torch.where(count > 0, (lens[None, :] * longer).sum(1) / count.clamp(min=1),
                       torch.full_like(gen, float(max_new_tokens)))
    return float((mean - gen).clamp(min=0).max()) * step_s


class EarlyStop:
    """Finished-group count of one generate call with ``num_prompts`` prompts of ``n`` samples."""

    def __init__(self, keep_groups: int, num_prompts: int, n: int, group: Optional[Any] = None,
                 lockstep: bool = False) -> None:
        """``group``: one rank per rollout replica (None: count this call's groups alone). ``lockstep``: wait for
        each round (a tensor-parallel rollout: its peers must stop at the same iteration)."""
        self.keep_groups, self.n, self.group, self.lockstep = keep_groups, n, group, lockstep
        self._dev = None
        self._work: Any = None  # the all-reduce round in flight
        self._sum: Optional[Tensor] = None
        if group is not None and dist.get_world_size(group) > 1:
            self._dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
                else torch.device("cpu")
        else:
            self.group = None
        self.left = [n] * num_prompts  # unfinished samples per prompt
        self.done = 0
        self.finished_lens: list[int] = []
        self.aborted = torch.zeros(num_prompts, dtype=torch.bool)
        self.saved_s = 0.0

    def reached(self) -> bool:
        """Whether ``keep_groups`` groups are done. Over ``group`` the count is an all-reduce in flight: this
        returns False until the round in flight completes (no replica waits for the others' decode steps),
        then starts the next round; every replica sees the same sums round by round, so all stop after the
        same round."""
        if self.group is None:
            return self.done >= self.keep_groups
        if self._work is None:
            self._sum = torch.tensor([float(self.done)], dtype=torch.float64, device=self._dev)
            self._work = dist.all_reduce(self._sum, group=self.group, async_op=True)
            return False
        if not self.lockstep and not self._work.is_completed():
            return False
        self._work.wait()
        self._work = None
        return self._sum.item() >= self.keep_groups

    def wait_for_peers(self) -> None:
        """This replica has nothing left: take part in the count until the other replicas reach the total."""
        while self.group is not None and not self.reached():
            if self._work is not None:
                self._work.wait()  # idle: block on the round instead of spinning

    def finished(self, rows: list[int], lens: list[int]) -> None:
        """Output rows ``rows`` (``prompt * n + sample``) finished with ``lens`` tokens."""
        self.finished_lens.extend(lens)
        for r in rows:
            p = r // self.n
            self.left[p] -= 1
            if self.left[p] == 0:
                self.done += 1

    def stop(self, run: Any) -> None:
        """Abort everything ``run`` (a ``rlhf.rollout.scheduler.GenerateRun``) still holds."""
        t0 = time.perf_counter()
        live = run.live
        gen = run.slots.gen[:live].tolist() if live else []
        aborted_gen = gen + [run.resume_gen[q] for q in run.queue]
        if run.lot is not None:
            for p in run.lot.parked.values():
                aborted_gen.append(p.length)
                if p.blocks is not None:
                    run.cache.free_blocks(p.blocks)
            forget = getattr(run.lot.handler, "abandon", None)
            if forget is not None:
                forget(list(run.lot.parked))
            run.lot.parked.clear()
            run.lot.ready.clear()
        if live:
            run.cache.release(list(range(live)))
            run.slots.token[:live] = 0  # as _compact: vacated slots still run in a static all-slot decode
            run.slots.pos[:live] = 0
            run.live = 0
        run.queue.clear()
        steps = run.stats["decode_steps"]
        step_s = run.stats["decode_s"] / steps if steps else 0.0
        self.saved_s = estimated_saved_s(self.finished_lens, aborted_gen, run.R, step_s)
        self.aborted = torch.tensor([k > 0 for k in self.left], dtype=torch.bool)
        run.stats["decode_s"] += time.perf_counter() - t0

    def row_flags(self, device: torch.device) -> Tensor:
        """``[num_prompts * n]`` bool: the rows of aborted groups."""
        return self.aborted.repeat_interleave(self.n).to(device)

    def stats(self) -> dict[str, float]:
        return {"aborted": float(int(self.aborted.sum())), "over_sample_saved_s": self.saved_s}
