"""Entry point of one reward worker process (started by :class:`rlhf.rewards.pool.RewardPool`).

    python -m rlhf.rewards.worker <fd>

``fd`` is the worker's end of a socket pair wrapped as a ``multiprocessing`` Connection.
Protocol (pickled tuples):

* parent -> worker: ``("init", spec, reward_kwargs)`` once, then ``("work", [(job, i,
  data_source, response, ground_truth, extra_info), ...])``;
* worker -> parent: ``("ready",)`` or ``("init_error", message)``, then one
  ``("ok", job, i, score, metrics, pred)`` / ``("fail", job, i, message)`` per sample, in order.

A tool worker (:class:`rlhf.agent.runner.ToolPool`, running :mod:`rlhf.agent.tool_worker`, which
calls :func:`main` with its own runner) gets ``("init_tools", tool_specs)`` instead,
then ``("work", [(job, i, tool_name, arguments), ...])`` and answers ``("ok", job, i, text, error
kind or None)`` (a tool that raises is an answer, not a failure of the worker).

The worker is a fresh interpreter (not a fork of a trainer holding CUDA / NCCL state) and
imports neither torch nor the training script, so it starts in well under a second. The
parent enforces the timeout by killing the process; this side only computes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable, Optional


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a reward call would outlive a parent killed with SIGKILL.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(fd: int, make_runner: Optional[Callable] = None) -> None:
    """Serve one pool's calls; ``make_runner(*init)`` returns the function each sample goes through
    (default: the reward function named by the ``init`` message)."""
    # Ctrl-C reaches the whole process group; the parent decides when workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    try:
        _serve(conn, make_runner)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return  # the parent closed the pool (a replaced worker, a run that ended): nothing to report to


def _serve(conn: Connection, make_runner: Optional[Callable]) -> None:
    kind, *init = conn.recv()
    try:
        run = (make_runner or _reward_runner)(*init)
    except Exception as e:  # reported to the parent, which fails the run with this message
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pool
        for job, i, *sample in msg[1]:
            try:
                out = run(*sample)
            except Exception as e:  # user code: the sample scores 0 (the call fails) and is counted by the parent
                conn.send(("fail", job, i, f"{type(e).__name__}: {e}"))
                continue
            conn.send(("ok", job, i, *out))


def _reward_runner(spec: str, reward_kwargs):
    from rlhf.rewards.registry import get_reward_fn
    from rlhf.rewards.scoring import score_one

    fn = get_reward_fn(spec, reward_kwargs)
    return lambda *sample: score_one(fn, *sample)


if __name__ == "__main__":
    main(int(sys.argv[1]))
