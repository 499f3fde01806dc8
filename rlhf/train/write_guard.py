"""Writes that end every rank the same way: a checkpoint or HF export that fails on one rank.

A full disk (or a quota, a read-only mount) shows on the rank that writes, as an ``OSError``,
a ``RuntimeError`` from torch's zip writer or a safetensors error. Raised there, it ends that
rank with a traceback while its peers wait in the next collective and die of "Connection
closed by peer". Here each write step catches its failure locally, the ranks then agree on
the first one (one all-gather, which is also the barrier the step needed), and every rank
raises the same :class:`SaveFailedError`, which the entry points print as one ``error:`` line
naming the path, the bytes the write needed (when known), the free space and what was kept.
"""

from __future__ import annotations

import errno
import shutil
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from rlhf.models.parallel import all_gather_object


class SaveFailedError(RuntimeError):
    """A checkpoint or HF export could not be written; the message says where, why and what was kept."""


# How a full disk reads in the errors of the writers a checkpoint uses (open/write, safetensors' Rust
# writer, torch's zip writer: a failed or short write).
_NO_SPACE = ("no space left on device", "os error 28", "storagefull", "file write failed", "unexpected pos")


def is_write_error(e: BaseException) -> bool:
    """An error of the storage (not of the program): full, over quota, read-only, or a failed write."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES):
        return True
    return any(s in str(e).lower() for s in _NO_SPACE)


def _root_cause(e: BaseException) -> BaseException:
    """The first failing rank's exception inside DCP's ``CheckpointException``, else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def describe(e: BaseException, path: Path) -> str:
    """One line: what failed writing where (``path``: what was being written, when the error names no file)."""
    e = _root_cause(e)
    where = getattr(e, "filename", None) or path
    if isinstance(e, OSError) and e.strerror:
        what = e.strerror[0].lower() + e.strerror[1:]
    elif any(s in str(e).lower() for s in _NO_SPACE[:3]):
        what = "no space left on device"
    else:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        what = f"{type(e).__name__}: {first[:200]}"
    return f"{what} writing {where}"


def attempt(fn: Callable[[], object], path: Path) -> Optional[str]:
    """Run one rank-local write; None when it worked, else its one-line description. An error that is not
    the storage's also ends the save on every rank, but its traceback is printed here first."""
    try:
        fn()
        return None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure must reach the peers
        if not is_write_error(_root_cause(e)):
            traceback.print_exc(file=sys.stderr)
        return describe(e, path)


def agree(problem: Optional[str], group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
    """The first rank's problem (None when every rank succeeded), the same on every rank of ``group``: a
    collective that stands in for the barrier after a write step."""
    if not dist.is_initialized():
        return problem
    problems = all_gather_object(problem, group)
    first = next(((r, p) for r, p in enumerate(problems) if p), None)
    if first is None:
        return None
    return first[1] if len(problems) == 1 else f"{first[1]} (on rank {first[0]})"


def free_bytes(path: Path) -> Optional[int]:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def full_disk(problem: str, path: Path, needed: Optional[int]) -> str:
    """``problem``, said to be a full disk when the writer's error did not say so but the free space does
    (torch's zip writer reports a short write as ``unexpected pos``). Before the partial files go."""
    free = free_bytes(path)
    if needed and free is not None and free < needed and "no space left" not in problem:
        what, _, where = problem.rpartition(" writing ")
        return f"no space left on device writing {where} (the writer said {what})" if what else \
            f"no space left on device ({problem})"
    return problem


def space_note(path: Path, needed: Optional[int], like: Optional[Path] = None) -> str:
    """`` (needs X, Y free)`` with the parts that are known (after the partial files were removed). ``like``:
    an earlier copy of what was written (the last checkpoint), whose size on disk is what is needed;
    else ``needed`` (the tensors' bytes) is a lower bound: file formats add a few KB per tensor."""
    free = free_bytes(path)
    size = sum(f.stat().st_size for f in like.rglob("*") if f.is_file()) if like is not None else None
    need = f"needs about {fmt_bytes(size)}, as {like.name} took" if size else \
        f"needs at least {fmt_bytes(needed)}" if needed else None
    parts = ([need] if need else []) + ([f"{fmt_bytes(free)} free"] if free is not None else [])
    return f" ({', '.join(parts)})" if parts else ""
