"""Reward scoring that cannot hang the job: worker processes with a per-call timeout.

The scorer interface (every scorer here has it)::

    score(texts, ground_truths, data_sources, extra_infos) -> ScoreResult   # blocking
    submit(texts, ground_truths, data_sources, extra_infos) -> ticket       # returns at once
    result(ticket) -> ScoreResult                                           # waits for it
    close()

``submit`` / ``result`` let a caller overlap scoring with other work (e.g. decoding the
next chunk). Implementations:

* :class:`SerialScorer` (``reward.num_workers: 0``): the function runs in this process, in
  ``result``; no timeout can be enforced.
* :class:`RewardPool` (``reward.num_workers > 0``): ``num_workers`` processes, each a fresh
  interpreter running :mod:`rlhf.rewards.worker`. A call that runs longer than
  ``timeout_s`` gets its worker killed; a worker that dies (segfault, ``os._exit``) is
  noticed by the closed connection. Either way that one sample scores 0, is counted
  (``ScoreResult.n_timeouts`` / ``n_errors``), the rest of the worker's chunk goes back in
  the queue and a new worker replaces it. A worker that cannot load the reward function
  fails the run with the worker's message.
* :class:`SharedScorer`: tensor / pipeline peers hold the same rows; only the first rank
  of each model-parallel group scores and broadcasts the result, so peers never disagree
  (a timeout is not deterministic) and the work is not repeated.

Reward functions reach the workers by spec string (registered name, ``file.py:fn`` or
``package.module:fn``), never by pickling a function, so any start method is safe.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Protocol, Sequence

from rlhf.rewards.registry import get_reward_fn
from rlhf.rewards.scoring import ScoreCollector, ScoreResult, aligned, score_batched, score_responses

# A worker that has not loaded its reward function after this long is broken, not slow.
STARTUP_TIMEOUT_S = 300.0
# Samples sent to a worker at once; on a timeout the unfinished rest of a chunk is requeued.
MAX_CHUNK = 16


class Scorer(Protocol):
    def score(self, texts: Sequence[str], ground_truths: Sequence[str], data_sources: Sequence[str],
              extra_infos: Optional[Sequence[Optional[dict]]] = None) -> ScoreResult: ...

    def submit(self, texts: Sequence[str], ground_truths: Sequence[str], data_sources: Sequence[str],
               extra_infos: Optional[Sequence[Optional[dict]]] = None) -> int: ...

    def result(self, ticket: int) -> ScoreResult: ...

    def close(self) -> None: ...


def _aligned(texts, ground_truths, data_sources, extra_infos) -> list:
    return [list(texts), list(ground_truths), list(data_sources), aligned(texts, ground_truths, data_sources, extra_infos)]


class SerialScorer:
    """The reward function in this process (no timeout); scored when ``result`` is asked for.
    ``batched``: verl's ``reward_manager: batch``, one call for the whole batch (:func:`score_batched`)."""

    def __init__(self, spec: str, reward_kwargs: Optional[dict] = None, *, batched: bool = False) -> None:
        self.fn = get_reward_fn(spec, reward_kwargs)
        self.batched = batched
        self._pending: dict[int, list] = {}
        self._ids = itertools.count()

    def submit(self, texts, ground_truths, data_sources, extra_infos=None) -> int:
        ticket = next(self._ids)
        self._pending[ticket] = _aligned(texts, ground_truths, data_sources, extra_infos)
        return ticket

    def result(self, ticket: int) -> ScoreResult:
        texts, gts, dss, extras = self._pending.pop(ticket)
        return (score_batched if self.batched else score_responses)(self.fn, texts, gts, dss, extras)

    def score(self, texts, ground_truths, data_sources, extra_infos=None) -> ScoreResult:
        return self.result(self.submit(texts, ground_truths, data_sources, extra_infos))

    def close(self) -> None:
        self._pending.clear()


@dataclass
class _Job:
    samples: list  # [(data_source, response, ground_truth, extra_info)]; tool calls: [(name, arguments)]
    collector: Any  # ScoreCollector; tool calls: rlhf.agent.runner.ToolCollector
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)


class _Worker:
    """One child process and the parent's end of its connection."""

    def __init__(self, init: tuple, module: str) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(child_sock.fileno())],
                                     pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL, env=env)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send(init)
        self.ready = False
        self.inflight: collections.deque = collections.deque()  # (job id, sample index), in order
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def stop(self) -> int:
        """Kill and reap; returns the exit code (negative: the signal)."""
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


class RewardPool:
    """``num_workers`` reward processes with a per-call timeout (see the module docstring).

    A daemon thread feeds the workers and collects results, so work submitted with
    :meth:`submit` progresses while the caller does something else. :meth:`done` and
    :meth:`wait_any` look at tickets without blocking on one of them.

    The same machinery runs tool calls (:class:`rlhf.agent.runner.ToolPool`): a subclass sends
    another ``init`` message to its workers and names itself differently in messages.
    """

    role = "reward"
    # The module each worker process runs (`python -m`); the tool pool names its own, so that this
    # layer never imports the tools.
    worker_module = "rlhf.rewards.worker"
    timeout_key = "reward.timeout_s"

    def __init__(self, spec: str, reward_kwargs: Optional[dict] = None, *, num_workers: int, timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1 for a pool, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        get_reward_fn(spec, reward_kwargs)  # a bad spec fails here, with the registry's message
        self.reward_kwargs = reward_kwargs
        self._start(spec, ("init", spec, reward_kwargs), num_workers, timeout_s)

    def _start(self, spec: str, init: tuple, num_workers: int, timeout_s: float) -> None:
        """Start ``num_workers`` workers that receive ``init`` first (``spec`` names what they load)."""
        self.spec, self._init, self.timeout_s = spec, init, timeout_s
        self.progress_s = max(2.0 * timeout_s, 30.0)  # a progress line this often while a batch is scored
        self.restarts = 0
        self._lock = threading.Lock()
        self.set_fail_fast(False)
        self._progress = threading.Condition(self._lock)  # notified when a sample finishes
        self._jobs: dict[int, _Job] = {}
        self._queue: collections.deque = collections.deque()  # (job id, sample index)
        self._ids = itertools.count()
        self._fatal: Optional[str] = None
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._workers = [_Worker(init, self.worker_module) for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._loop, name="reward-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the scorer interface

    def submit(self, texts, ground_truths, data_sources, extra_infos=None) -> int:
        texts, gts, dss, extras = _aligned(texts, ground_truths, data_sources, extra_infos)
        return self._enqueue(list(zip(dss, texts, gts, extras)), ScoreCollector(dss))

    def _enqueue(self, samples: list, collector: Any) -> int:
        """Queue ``samples`` (tuples the workers' runner takes) whose outcomes go to ``collector``."""
        job = _Job(samples, collector, len(samples))
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            if self._fatal is not None:
                raise RuntimeError(self._fatal)
            ticket = next(self._ids)
            self._jobs[ticket] = job
            self._queue.extend((ticket, i) for i in range(job.remaining))
            if job.remaining == 0:
                job.done.set()
        self._wake()
        return ticket

    def done(self, ticket: int) -> bool:
        """Whether ``result(ticket)`` would return at once."""
        return self._jobs[ticket].done.is_set()

    def wait_any(self, tickets: Sequence[int], timeout: Optional[float] = None) -> list[int]:
        """The finished ones of ``tickets``, waiting up to ``timeout`` seconds (None: for ever) until
        there is at least one (an empty ``tickets`` returns at once)."""
        jobs = [(t, self._jobs[t]) for t in tickets]
        with self._progress:
            self._progress.wait_for(lambda: not jobs or self._fatal is not None or
                                    any(j.done.is_set() for _, j in jobs), timeout)
        return [t for t, j in jobs if j.done.is_set()]

    def result(self, ticket: int) -> ScoreResult:
        job = self._jobs[ticket]
        while not job.done.wait(self.progress_s):
            self._report_progress(job)
        with self._lock:
            del self._jobs[ticket]
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        return job.collector.result()

    def score(self, texts, ground_truths, data_sources, extra_infos=None) -> ScoreResult:
        return self.result(self.submit(texts, ground_truths, data_sources, extra_infos))

    def _report_progress(self, job: _Job) -> None:
        """A batch still being scored after ``progress_s``: a line (global rank 0) with how far it got, so
        a slow or hanging reward function shows during the step, not only in its metrics."""
        if self.role != "reward" or os.environ.get("RANK", "0") != "0":
            return
        n, c = len(job.samples), job.collector
        print(f"[rlhf] reward: {n - job.remaining}/{n} samples of this batch done on rank 0 so far, "
              f"{c.n_timeouts} timed out after reward.timeout_s={self.timeout_s:g} s each, {c.n_errors} failed "
              f"({len(self._workers)} workers, reward.num_workers)", flush=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join()
        for w in self._workers:
            w.stop()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the feeding thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug here must fail the waiting caller, not hang it
            self._fail_all(f"reward pool thread crashed: {type(e).__name__}: {e}")
            raise

    def _serve(self) -> None:
        while True:
            with self._lock:
                if self._closed or self._fatal is not None:
                    return
                self._dispatch()
            now = time.monotonic()
            busy = [w.deadline for w in self._workers if w.inflight or not w.ready]
            timeout = max(0.0, min(busy) - now) if busy else None
            ready = wait([self._wake_r] + [w.conn for w in self._workers], timeout)
            for obj in ready:
                if obj is self._wake_r:
                    self._wake_r.recv(4096)
                    continue
                worker = next(w for w in self._workers if w.conn is obj)
                self._receive(worker)
            now = time.monotonic()
            for w in list(self._workers):
                if (w.inflight or not w.ready) and now >= w.deadline:
                    if not w.ready:
                        self._fail_all(f"{self.role} worker did not load '{self.spec}' within {STARTUP_TIMEOUT_S:.0f} s")
                        return
                    self._replace(w, f"timed out after {self.timeout_s:g} s ({self.timeout_key})", timeout=True)

    def _dispatch(self) -> None:
        """Give queued samples to idle ready workers (called with the lock held)."""
        if self._tripped:
            self._time_out_queued()
        idle = [w for w in self._workers if w.ready and not w.inflight]
        for w in idle:
            if not self._queue:
                return
            size = max(1, min(MAX_CHUNK, len(self._queue) // (4 * len(self._workers))))
            chunk = [self._queue.popleft() for _ in range(min(size, len(self._queue)))]
            w.inflight.extend(chunk)
            w.deadline = time.monotonic() + self.timeout_s
            w.conn.send(("work", [(job, i, *self._jobs[job].samples[i]) for job, i in chunk]))

    def _receive(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                self._fail_all(f"{self.role} worker for '{self.spec}' exited at start-up (exit code {w.stop()}); "
                               f"see its traceback above")
                return
            self._replace(w, f"{self.role} worker died (exit code {{code}})", timeout=False)
            return
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "init_error":
            self._fail_all(self._init_error(msg[1]))
        else:
            job_id, i = w.inflight.popleft()
            assert (job_id, i) == (msg[1], msg[2]), "reward worker answered out of order"
            w.deadline = time.monotonic() + self.timeout_s  # the next sample starts now
            with self._lock:
                job = self._jobs[job_id]
                if kind == "ok":
                    job.collector.ok(i, *msg[3:])
                else:
                    job.collector.fail(i, msg[3])
                self._answers += 1
                self._finish_one(job)

    def _init_error(self, message: str) -> str:
        return (f"reward worker could not load reward.reward_fn '{self.spec}': {message} (a function "
                f"registered in the training script is not visible to worker processes: give "
                f"path/to/file.py:function or set reward.num_workers: 0)")

    def _finish_one(self, job: _Job) -> None:
        """(With the lock held.)"""
        job.remaining -= 1
        if job.remaining == 0:
            job.done.set()
            self._progress.notify_all()

    def _replace(self, w: _Worker, reason: str, *, timeout: bool) -> None:
        """The worker's current sample scores 0 and is counted; the rest of its chunk is requeued."""
        code = w.stop()
        self.restarts += 1
        with self._lock:
            if w.inflight:
                job_id, i = w.inflight.popleft()
                job = self._jobs[job_id]
                job.collector.fail(i, reason.format(code=code), timeout=timeout)
                self._finish_one(job)
            self._queue.extendleft(reversed(w.inflight))
            self._workers[self._workers.index(w)] = _Worker(self._init, self.worker_module)
            self._timeouts += timeout
            trip = (self.fail_fast and not self._tripped and not self._answers
                    and self._timeouts >= len(self._workers))
            self._tripped = self._tripped or trip
        if trip:
            self._cut_short()

    def set_fail_fast(self, on: bool) -> None:
        """Called at the start of each step (the trainer's FailedStepGuard). ``on``: once as many calls as
        there are workers have timed out in this step and none has answered (every worker hung), the
        rest of this step's calls fail at once: the calls still running are cut short (timeouts) and
        every queued or later submitted one is failed untried (timeouts, counted in ``n_untried``). A
        step whose every call hangs so costs one ``timeout_s``, not (samples / workers) x ``timeout_s``.
        Off (a pool nobody steps, e.g. the tool pool or ``python -m rlhf.eval``): every call is tried."""
        with self._lock:
            self.fail_fast, self._answers, self._timeouts, self._tripped = on, 0, 0, False

    def _cut_short(self) -> None:
        """(fail_fast tripped.) The calls still running time out now: their workers are as hung as the others."""
        for w in list(self._workers):  # each replaced once: the replacements are not ready yet
            if w.ready and w.inflight:
                self._replace(w, f"cut short: {len(self._workers)} calls timed out after "
                                 f"{self.timeout_s:g} s ({self.timeout_key}) in this step, none answered", timeout=True)

    def _time_out_queued(self) -> None:
        """(With the lock held.) Every queued sample times out without being tried (fail_fast tripped)."""
        while self._queue:
            job_id, i = self._queue.popleft()
            job = self._jobs[job_id]
            job.collector.fail(i, f"not tried: {len(self._workers)} calls timed out after "
                                  f"{self.timeout_s:g} s ({self.timeout_key}) in this step, none answered",
                               timeout=True, untried=True)
            self._finish_one(job)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._fatal = message
            for job in self._jobs.values():
                job.done.set()
            self._progress.notify_all()


class SharedScorer:
    """Score on the first rank of each model-parallel (tp x pp) group, broadcast to its peers."""

    def __init__(self, inner: Scorer, group, src: int, is_src: bool) -> None:
        self.inner, self.group, self.src, self.is_src = inner, group, src, is_src

    def submit(self, texts, ground_truths, data_sources, extra_infos=None) -> int:
        return self.inner.submit(texts, ground_truths, data_sources, extra_infos) if self.is_src else -1

    def result(self, ticket: int) -> ScoreResult:
        import torch.distributed as dist

        box = [self.inner.result(ticket) if self.is_src else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def score(self, texts, ground_truths, data_sources, extra_infos=None) -> ScoreResult:
        return self.result(self.submit(texts, ground_truths, data_sources, extra_infos))

    def close(self) -> None:
        self.inner.close()


def model_parallel_group(mesh) -> Optional[tuple[Any, int]]:
    """``(group, src rank)`` of the ranks sharing this rank's dp coordinate (its pp / sp / tp peers,
    which hold the same rows); None when there are none.

    Only the members of each group create it, so a role of trainer.mode one_step_off can call
    it alone.
    """
    import torch.distributed as dist

    names = list(mesh.mesh_dim_names)
    # under parallel.ep the root mesh holds dp as (efsdp, ep), flattened into "dp" only as a sub-mesh
    dp_dims = [names.index("dp")] if "dp" in names else [names.index("efsdp"), names.index("ep")]
    t = mesh.mesh.permute(*dp_dims, *[i for i in range(len(names)) if i not in dp_dims])
    ranks = t.reshape(-1, *t.shape[len(dp_dims):])  # [dp, ...] global ranks
    if ranks[0].numel() == 1:
        return None
    mine = next(row.flatten().tolist() for row in ranks if dist.get_rank() in row.flatten().tolist())
    return dist.new_group(mine, use_local_synchronization=True), mine[0]


def make_scorer(spec: str, *, num_workers: int, timeout_s: float, reward_kwargs: Optional[dict] = None,
                mesh=None, manager: str = "naive") -> Scorer:
    """The scorer for ``reward.*``: serial (``num_workers: 0``) or a pool; shared over tp / pp peers of ``mesh``.
    ``manager``: verl's reward manager; ``batch`` calls the function once per batch in this process,
    the others (naive, prime, dapo) call it per sample."""
    import torch.distributed as dist

    shared = model_parallel_group(mesh) if mesh is not None else None
    is_src = shared is None or shared[1] == dist.get_rank()
    if manager == "batch":
        inner: Scorer = SerialScorer(spec, reward_kwargs, batched=True)
    elif num_workers == 0 or not is_src:
        # Peers that only receive need no processes; the serial scorer still checks the spec.
        inner: Scorer = SerialScorer(spec, reward_kwargs)
    else:
        inner = RewardPool(spec, reward_kwargs, num_workers=num_workers, timeout_s=timeout_s)
    return inner if shared is None else SharedScorer(inner, shared[0], shared[1], is_src)
