"""The built-in ``python`` tool: run a program in a subprocess with resource limits, return its output.

Each call gets a fresh temporary working directory and a fresh interpreter started through
:mod:`rlhf.agent.sandbox_boot`, which applies the isolation layers (its docstring lists them)
before the code runs. This side enforces the wall-clock limit (the whole process group is
killed), caps the output, and turns every limit that was hit into a clear error for the
model (a :class:`ToolError`, so the call is counted as a tool error):

===================  ===========================================================
infinite loop        ``RLIMIT_CPU`` (``cpu_time_s``); sleeping: the wall-clock kill
fork bomb            ``RLIMIT_NPROC`` (``max_processes``) in its own user namespace; as
                     root (which that limit does not bind) no process may start;
                     the pid namespace (or the process group) is killed at the end
huge allocation      ``RLIMIT_AS`` (``memory_mb``): a ``MemoryError`` in the code
network              no interface in its network namespace; Landlock TCP rules
writes outside dir   Landlock; the audit hook where Landlock is missing
huge output          ``RLIMIT_FSIZE`` on the output file, ``max_output_chars`` read back
huge files           ``RLIMIT_FSIZE`` per file (CPython ignores SIGXFSZ: the write raises
                     ``OSError: File too large``, reported as the limit); ``max_disk_mb``
                     for the whole directory, measured while it runs (the program is
                     killed past it) and once more at its end
===================  ===========================================================

What it does NOT isolate: it is not a VM or a container. The code shares the kernel (a
kernel exploit escapes), may read the Python installation and system libraries, and uses
CPU and memory of the machine within the limits above. Where the kernel refuses user
namespaces and Landlock (old kernels, some container runtimes), only the rlimits, the
process-group kill and the in-interpreter audit hook remain, and code using ``ctypes`` or
starting other programs can get past the audit hook. :meth:`PythonSandbox.isolation`
reports the layers a machine gives.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from rlhf.agent.base import Tool, ToolError

BOOT = str(Path(__file__).with_name("sandbox_boot.py"))


class PythonSandbox(Tool):
    """``python(code)`` -> what the program printed (stdout and stderr, interleaved)."""

    schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python 3 program in a sandbox (no network, limited CPU time and memory, a fresh "
                       "empty working directory) and return what it prints.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "The program; use print() to show results."}},
            "required": ["code"], "additionalProperties": False}}}

    def __init__(self, *, cpu_time_s: int = 2, wall_time_s: float = 5.0, memory_mb: int = 1024,
                 max_processes: int = 16, max_file_mb: int = 16, max_output_chars: int = 4000,
                 max_disk_mb: int = 64, use_namespaces: bool = True) -> None:
        """``use_namespaces: false`` skips the user / network / pid namespaces (e.g. to test the fallbacks)."""
        if min(cpu_time_s, wall_time_s, memory_mb, max_processes, max_file_mb, max_output_chars, max_disk_mb) <= 0:
            raise ValueError("python sandbox limits must all be > 0")
        self.max_disk_mb = int(max_disk_mb)
        self.limits = dict(cpu_time_s=int(cpu_time_s), memory_mb=int(memory_mb), max_processes=int(max_processes),
                           max_file_mb=int(max_file_mb), use_namespaces=bool(use_namespaces))
        self.wall_time_s = float(wall_time_s)
        self.max_output_chars = int(max_output_chars)
        self.last_layers: list[str] = []

    def __call__(self, code: str) -> str:
        tmp = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-"))
        try:
            return self._run(code, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def isolation(cls, **limits) -> list[str]:
        """The isolation layers this machine gives a sandboxed program (runs a trivial one)."""
        box = cls(**limits)
        box("pass")
        return box.last_layers

    def _run(self, code: str, tmp: Path) -> str:
        work = tmp / "work"
        work.mkdir()
        (work / "main.py").write_text(code)
        settings = dict(self.limits, workdir=str(work), status_path=str(tmp / "status.json"),
                        read_paths=sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/lib", "/lib64"}))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        killed = over_disk = False
        with open(tmp / "output", "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-B", "-u", BOOT, json.dumps(settings)], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline = time.monotonic() + self.wall_time_s
            while True:  # the wall clock, and the disk use of the whole call (files and output) every 50 ms
                try:
                    proc.wait(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if _disk_bytes(tmp) > self.max_disk_mb << 20:
                        over_disk = True
                        break
                    if time.monotonic() >= deadline:
                        killed = True
                        break
            self.last_layers = _read_json(tmp / "status.json") or []
            _kill_group(proc)
        over_disk = over_disk or _disk_bytes(tmp) > self.max_disk_mb << 20
        text = _read_capped(tmp / "output", self.max_output_chars)
        error = (f"error: disk limit of {self.max_disk_mb} MB per call exceeded (files written and output); "
                 f"the program was stopped") if over_disk else self._limit_error(proc.returncode, killed, text)
        if error is not None:
            raise ToolError(f"{text}\n{error}" if text else error)
        if proc.returncode:
            return f"{text}\n(exit code {proc.returncode})" if text else f"(exit code {proc.returncode})"
        return text if text else "(no output)"

    def _limit_error(self, rc: int, killed: bool, text: str) -> Optional[str]:
        lim = self.limits
        if killed:
            return f"error: wall-clock time limit of {self.wall_time_s:g} s exceeded; the program was killed"
        if rc in (-signal.SIGXCPU, -signal.SIGKILL):
            return f"error: CPU time limit of {lim['cpu_time_s']} s exceeded; the program was killed"
        if rc == -signal.SIGXFSZ or (rc and "File too large" in text):  # Python ignores SIGXFSZ: EFBIG
            return f"error: file size limit of {lim['max_file_mb']} MB exceeded (output or a file written)"
        if rc and "MemoryError" in text:
            return f"error: memory limit of {lim['memory_mb']} MB exceeded"
        if rc and "BlockingIOError" in text and "Resource temporarily unavailable" in text:
            if "seccomp_no_processes" in self.last_layers:
                return "error: the sandbox does not allow starting processes"
            return f"error: process limit of {lim['max_processes']} reached"
        if rc is not None and rc < 0:
            return f"error: the program was killed by signal {signal.Signals(-rc).name}"
        return None


def _disk_bytes(root: Path) -> int:
    """Bytes allocated under ``root`` (sparse files count what they use)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_capped(path: Path, max_chars: int) -> str:
    """The program's output; when longer than ``max_chars``, its start and its end (where a traceback ends)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace").rstrip("\n")
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n...[output cut to its first and last {half} characters]...\n{text[len(text) - half:]}"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill what is left of the program: its process group (a pid namespace dies with its init)."""
    for _ in range(100):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    proc.wait()
