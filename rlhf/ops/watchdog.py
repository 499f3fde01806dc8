"""A heartbeat watchdog: a stopped or stuck rank ends the job with one line naming it.

A collective waits for every rank of its group. If one rank is SIGSTOPped, lost with its
node, or stuck in rank-local work (a reward function that never returns), the others wait
until the process-group timeout and then fail with a transport error that names nobody (or,
on gloo's default of 30 minutes, look hung). Each rank here runs a daemon thread that talks
over a side channel that does not need the stuck rank: the job's TCPStore (torchrun's agent
hosts it at ``MASTER_ADDR:MASTER_PORT``). Every ``interval_s``, and at once when its phase
changes (so a rank stopped just after is named in its new phase), a rank writes
``[beat, phase, step, seq, done]`` to its key, where ``seq`` counts the phase boundaries
(:class:`rlhf.ops.metrics.PhaseTimer` enter and exit) its main thread has crossed. Ranks 0 and 1
watch every key and end the job when a rank

* has not beaten for ``heartbeat_timeout_s`` (the whole process is stopped or gone), or
* has stayed at one ``seq`` for ``stall_timeout_s`` *since another rank got past it* (its
  main thread is stuck outside the collective the others are waiting in). Counting from
  the moment another rank got ahead, not from when the slow rank entered its phase, keeps
  a long phase that every rank is in (a 20-minute generation) from ever counting as stuck.

Under trainer.mode fully_async the two roles do not cross the same phase boundaries (the
rollout ranks generate without pause while the training ranks step), so each rank also
publishes its ``role``: stalls compare ranks of one role only, and a role of independent
replicas (``role=None``: the rollout ranks) is checked by its heartbeat alone. One watchdog
covers the whole job there (:func:`job_watchdog`), started before the roles part ways; the
trainer's phase timer reuses it.

The watcher writes one line to an ``abort`` key; every rank's thread polls that key, prints
the line (the detector, and local rank 0 of each node, so every node's log shows it) and
leaves with ``os._exit(EXIT_CODE)``, which works even while the main thread is blocked in a
collective. torchrun then tears the job down (and with ``--max-restarts`` starts it again;
keys carry torchrun's restart count, so a restarted job never sees an old abort line).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from typing import Callable, Optional

EXIT_CODE = 3  # distinct from 1 (a Python exception) and 2 (a user error)


class Watchdog:
    """Heartbeat thread of one rank; a :class:`rlhf.ops.metrics.PhaseTimer` listener.

    Args:
        rank, world_size: this process in the job.
        store: a client of the job's TCPStore (:func:`connect_store`); used by the thread only.
        heartbeat_timeout_s: silence after which a rank counts as stopped.
        stall_timeout_s: time a rank may stay behind the others at one phase boundary.
        interval_s: seconds between beats.
        local_rank: local rank 0 prints the abort line too.
        exit_fn: how to leave (``os._exit``; tests pass a recorder).
        role: the ranks this one is compared with for stalls (same ``role``); None: heartbeat only.
    """

    def __init__(self, *, rank: int, world_size: int, store, heartbeat_timeout_s: float, stall_timeout_s: float,
                 interval_s: float = 1.0, local_rank: int = 0, prefix: str = "rlhf/watchdog/",
                 exit_fn: Callable[[int], None] = os._exit, role: Optional[str] = ""):
        self.rank, self.world_size, self.local_rank, self.role = rank, world_size, local_rank, role
        self.store = store
        self.heartbeat_timeout_s, self.stall_timeout_s, self.interval_s = heartbeat_timeout_s, stall_timeout_s, interval_s
        self.prefix, self.exit_fn = prefix, exit_fn
        self.phase, self.step, self.seq, self.done = "setup", 0, 0, False
        self.message: Optional[str] = None  # the abort line, once there is one
        self._beat = 0
        # rank -> (last value, when its beat last changed, when it fell behind at its current seq)
        self._seen: dict[int, tuple] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # a phase changed: publish it now, not at the next interval
        self._thread = threading.Thread(target=self._run, name="rlhf-watchdog", daemon=True)

    # ------------------------------------------------------------------ main-thread side

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def enter(self, phase: str, step: int) -> None:
        # Plain attribute writes (atomic under the GIL); the thread wakes and publishes them at once.
        self.phase, self.step = phase, step
        self.seq += 1
        self._wake.set()

    def exit(self, phase: str, step: int) -> None:
        self.phase = f"after {phase}"
        self.seq += 1
        self._wake.set()

    def abort(self, line: str) -> None:
        """End the whole job now with ``line`` (every rank's thread sees the abort key)."""
        try:
            self.store.set(self.prefix + "abort", line)
        except Exception:
            pass
        self._abort(line, detector=True)

    def finish(self) -> None:
        """This rank ended normally: the watchers stop expecting its beats."""
        self.done, self.phase = True, "done"
        try:
            self._publish()
        except Exception:  # the store may already be gone at interpreter exit
            pass
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------------ thread side

    def _key(self, r: int) -> str:
        return f"{self.prefix}hb/{r}"

    def _publish(self) -> None:
        self._beat += 1
        self.store.set(self._key(self.rank), json.dumps([self._beat, self.phase, self.step, self.seq, self.done, self.role]))

    def _abort(self, line: str, detector: bool) -> None:
        self.message = line
        if detector or self.local_rank == 0:
            print(line, file=sys.stderr, flush=True)
        self._stop.set()
        self._wake.set()
        self.exit_fn(EXIT_CODE)

    def _run(self) -> None:
        abort_key = self.prefix + "abort"
        while not self._stop.is_set():
            try:
                self._publish()
                if self.store.check([abort_key]):
                    self._abort(self.store.get(abort_key).decode(), detector=False)
                    return
                line = self.check_peers() if self.rank in (0, 1) else None
            except Exception as e:  # the store timed out: whoever hosts it is gone or stopped
                if self._stop.is_set():
                    return
                self._abort(f"[rlhf] watchdog (rank {self.rank}): the job's store at {os.environ.get('MASTER_ADDR')}:"
                            f"{os.environ.get('MASTER_PORT')} stopped responding ({type(e).__name__}); ending the job",
                            detector=True)
                return
            if line is not None:
                try:
                    self.store.set(abort_key, line)
                except Exception:
                    pass
                self._abort(line, detector=True)
                return
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def check_peers(self, now: Optional[float] = None) -> Optional[str]:
        """One look at every rank's beat; the abort line when a rank is stopped or stuck."""
        now = time.monotonic() if now is None else now
        keys = [self._key(r) for r in range(self.world_size)]
        if not self.store.check(keys):  # some rank has not started its thread yet
            return None
        values = [json.loads(v) for v in self.store.multi_get(keys)]
        max_seq: dict = {}  # role -> the furthest live rank of that role
        for v in values:
            role = v[5] if len(v) > 5 else ""
            if not v[4] and role is not None:
                max_seq[role] = max(max_seq.get(role, 0), v[3])
        for r, value in enumerate(values):
            beat, phase, step, seq, done = value[:5]
            role = value[5] if len(value) > 5 else ""
            old = self._seen.get(r)
            beat_at = now if old is None or old[0][0] != beat else old[1]
            behind = role is not None and seq < max_seq.get(role, 0)
            if not behind:
                behind_at = None
            elif old is not None and old[2] is not None and old[0][3] == seq:
                behind_at = old[2]  # still behind at the same boundary
            else:
                behind_at = now
            self._seen[r] = (value, beat_at, behind_at)
            if done or r == self.rank:
                continue
            where = f"in phase '{phase}' of step {step}"
            if now - beat_at > self.heartbeat_timeout_s:
                return (f"[rlhf] watchdog: rank {r} stopped responding (last seen {where}; no heartbeat for "
                        f"{now - beat_at:.0f} s > trainer.heartbeat_timeout_s={self.heartbeat_timeout_s:g}); ending the job")
            if behind and now - behind_at > self.stall_timeout_s:
                return (f"[rlhf] watchdog: rank {r} is stuck {where}: the other ranks have waited {now - behind_at:.0f} s "
                        f"for it (trainer.collective_timeout_s); ending the job")
        return None


def connect_store(timeout_s: float):
    """A private client of the job's TCPStore (torchrun's agent store)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


_JOB: Optional[Watchdog] = None  # the whole job's, when one was started before a role split


def job_watchdog(*, rank: int, world_size: int, local_rank: int, collective_timeout_s: float,
                 heartbeat_timeout_s: float, role: Optional[str]) -> Optional[Watchdog]:
    """Start this rank's watchdog over all ``world_size`` ranks, tagged with its ``role``; a later
    :func:`start_watchdog` in this process (the trainer's, on a role's smaller world) returns it."""
    global _JOB
    _JOB = start_watchdog(rank=rank, world_size=world_size, local_rank=local_rank,
                          collective_timeout_s=collective_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s, role=role)
    return _JOB


def start_watchdog(*, rank: int, world_size: int, local_rank: int, collective_timeout_s: float,
                   heartbeat_timeout_s: float, role: Optional[str] = "") -> Optional[Watchdog]:
    """The running watchdog of this rank; None for one process, ``heartbeat_timeout_s = 0``, or a
    process group not set up from ``MASTER_ADDR`` / ``MASTER_PORT`` (no store to reach).

    A stall is declared a little before the process-group timeout, so that the line naming
    the rank comes before the collective's own (anonymous) timeout error. Rank-local work that
    may hang must be a phase of its own, ending before the collective that waits for it (the
    trainer's "reward_fn" phase), or the waiting ranks would not be seen to be ahead.
    """
    if _JOB is not None and not _JOB._stop.is_set():
        return _JOB
    if world_size < 2 or heartbeat_timeout_s <= 0 or not {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        return None
    interval = min(5.0, max(0.2, heartbeat_timeout_s / 5))
    stall = max(interval, 0.9 * collective_timeout_s - 2 * interval)
    prefix = (f"rlhf/watchdog/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    store = connect_store(max(heartbeat_timeout_s, 10.0))
    return Watchdog(rank=rank, world_size=world_size, store=store, heartbeat_timeout_s=heartbeat_timeout_s,
                    stall_timeout_s=stall, interval_s=interval, local_rank=local_rank, prefix=prefix,
                    role=role).start()
