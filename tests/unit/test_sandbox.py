"""The python sandbox tool: each abuse returns a clear error within its limits, and the tool worker
pool that runs it keeps answering (no worker killed, nothing left running)."""

from __future__ import annotations

import os
import re

import pytest

from rlhf.agent.runner import ToolPool
from rlhf.agent.sandbox import PythonSandbox
from rlhf.agent.tools import ToolError

LIMITS = dict(cpu_time_s=1, wall_time_s=2, memory_mb=512, max_processes=8, max_output_chars=300, max_disk_mb=32)
LAYERS = PythonSandbox.isolation(**LIMITS)
needs = lambda layer: pytest.mark.skipif(layer not in LAYERS, reason=f"this kernel gives no {layer}")  # noqa: E731

ABUSE = {
    # On a busy machine the wall clock may run out before 1 s of CPU time: either is the answer.
    "infinite loop": ("while True:\n    pass", r"(CPU|wall-clock) time limit of [12] s exceeded"),
    "sleeping loop": ("import time\nwhile True:\n    time.sleep(0.1)", "wall-clock time limit of 2 s"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "process"),
    "10 GB allocation": ("x = bytearray(10 * 2**30)", "memory limit of 512 MB exceeded"),
    "network call": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
                     "network access is disabled|Network is unreachable"),
    "write outside": ("open('/tmp/rlhf_sandbox_escape.txt', 'w').write('x')", "outside the working directory"),
    # issue 33: CPython ignores SIGXFSZ (the write raises EFBIG), and many files under the per-file limit
    # wrote 0.6-0.8 GB in one call
    "20 MB file": ("open('big', 'wb').write(b'x' * 20 * 2**20)", "file size limit of 16 MB exceeded"),
    "many 1 MB files": ("for i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)",
                        "disk limit of 32 MB per call exceeded"),
}


@pytest.fixture(scope="module")
def pool():
    spec = [("python", LIMITS, PythonSandbox.schema)]
    with ToolPool(spec, num_workers=1, timeout_s=20) as p:
        yield p


@pytest.mark.parametrize("name", list(ABUSE))
def test_abuse_is_a_clear_error_and_the_pool_keeps_going(pool, name):
    code, message = ABUSE[name]
    res = pool.take(pool.submit("python", {"code": code}))
    assert re.search(message, res.text), res.text  # the sandbox's answer, not the pool's timeout
    assert res.error != "timeout"
    after = pool.take(pool.submit("python", {"code": "print(6 * 7)"}))
    assert (after.text, after.error) == ("42", None)
    assert pool.restarts == 0
    assert not os.path.exists("/tmp/rlhf_sandbox_escape.txt")


def test_limit_hits_are_tool_errors_and_program_errors_are_output():
    box = PythonSandbox(**LIMITS)
    with pytest.raises(ToolError, match="memory limit"):
        box(code=ABUSE["10 GB allocation"][0])
    out = box(code="print('partial')\n1/0")
    assert out.startswith("partial\nTraceback") and "ZeroDivisionError" in out and out.endswith("(exit code 1)")
    assert "sandbox_boot" not in out and "runpy" not in out  # only the program's own frames
    assert box(code="pass") == "(no output)"
    long = box(code="print('a' * 5000 + 'b' * 5000)")
    assert long.startswith("a" * 150 + "\n...[output cut to its first and last 150 characters]...\n" + "b" * 150)
    assert len(long) < 400
    assert box(code="open('here.txt', 'w').write('ok'); print(open('here.txt').read())") == "ok"


def test_fresh_directory_per_call_and_no_secrets_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLHF_TEST_SECRET", "hunter2")
    box = PythonSandbox(**LIMITS)
    box(code="open('left.txt', 'w').write('x')")
    assert box(code="import os; print(sorted(os.listdir('.')), os.environ.get('RLHF_TEST_SECRET'))") == \
        "['main.py'] None"


@needs("landlock_fs")
def test_kernel_refuses_writes_the_audit_hook_does_not_see():
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = libc.open(b'/tmp/rlhf_sandbox_escape.txt', 0o101, 0o644)\nprint(fd, ctypes.get_errno())")
    fd, errno = PythonSandbox(**LIMITS)(code=code).split()
    assert fd == "-1" and errno == "13"  # EACCES from Landlock
    assert not os.path.exists("/tmp/rlhf_sandbox_escape.txt")


@needs("netns")
def test_kernel_refuses_connections_the_audit_hook_does_not_see():
    code = ("import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\ns = socket.socket()\n"
            "addr = struct.pack('=HH4s8x', socket.AF_INET, socket.htons(80), bytes([1, 1, 1, 1]))\n"
            "print(libc.connect(s.fileno(), addr, len(addr)), ctypes.get_errno())")
    rc, errno = PythonSandbox(**LIMITS)(code=code).split()
    assert rc == "-1" and errno in ("101", "13")  # ENETUNREACH (no interface) or EACCES (Landlock)
