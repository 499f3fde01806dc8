"""Spawn N gloo processes on CPU and run one function in each (multi-process tests).

Usage::

    def _check(rank: int, world_size: int, x: int) -> None:   # module level, picklable
        ...  # torch.distributed is initialised (gloo), assert freely

    def test_something():
        run_distributed(_check, 4, 123)

Each worker uses one thread (the test machines have few cores), a FileStore rendezvous
in a temporary directory (no port to collide on), and a process-group timeout so that
a collective mismatch fails the test instead of hanging it. An exception or failed
assert in any worker fails the call with that worker's traceback.

On CPU the workers are forked from a forkserver that imported torch, transformers and the
trainer once per test session: a spawned interpreter pays ~5 s of CPU for those imports, per
rank and per call, which was a large share of the multi-process tier's time. Each worker takes
the caller's current environment and working directory, as a spawned one would.

Backend switch: with ``RLHF_DIST_DEVICE=cuda`` the same tests run on nccl, one GPU per
rank (``tests/gpu/test_dist_nccl.py`` does this); tests that place tensors or build meshes
use :func:`dist_device` / :func:`dist_device_type` instead of naming "cpu", and a call
that needs more ranks than there are GPUs is skipped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICE_ENV = "RLHF_DIST_DEVICE"


def dist_device_type() -> str:
    """The device kind from ``RLHF_DIST_DEVICE``: cpu (gloo, the default) or cuda (nccl)."""
    kind = os.environ.get(DEVICE_ENV, "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={kind!r}: expected cpu or cuda")
    return kind


def dist_device() -> torch.device:
    """This rank's device: the CPU, or GPU ``LOCAL_RANK`` under the nccl switch."""
    if dist_device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


# Imported once by the forkserver, then shared by every worker it forks.
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "transformers", "rlhf.train.trainer",
            "tests.dist._dist_utils"]


def _worker(
    rank: int,
    fn: Callable[..., None],
    world_size: int,
    store_path: str,
    args: tuple[Any, ...],
    timeout_s: float,
    env: dict[str, str],
    cwd: str,
) -> None:
    # A forked worker starts with the forkserver's environment, taken when the server started.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    store = dist.FileStore(store_path, world_size)
    cuda = dist_device_type() == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
        # Without it a fast rank can tear down gloo while a peer still finishes its last
        # collective, which sometimes aborts the peer after the test's work is done.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 180.0
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes (forked from the forkserver;
    ``RLHF_TEST_START_METHOD=spawn`` starts fresh interpreters instead).

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level). Raises
    ``torch.multiprocessing.ProcessRaisedException`` carrying the failing rank's
    traceback when any worker raises. Under the nccl switch, skips the calling test when
    there are fewer GPUs than ``world_size``.
    """
    if dist_device_type() == "cuda" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"needs {world_size} GPUs for {world_size} nccl ranks; {torch.cuda.device_count()} visible")
    # CUDA state must not be inherited through a fork: the nccl switch keeps fresh interpreters.
    method = "spawn" if dist_device_type() == "cuda" else os.environ.get("RLHF_TEST_START_METHOD", "forkserver")
    if method == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(fn, world_size, os.path.join(tmp, "store"), args, timeout_s, dict(os.environ), os.getcwd()),
            nprocs=world_size,
            join=True,
            start_method=method,
        )
