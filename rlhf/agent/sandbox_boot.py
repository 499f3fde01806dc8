"""Runs as the sandbox's child process: applies the isolation layers, then runs ``main.py``.

    python -I -B -u sandbox_boot.py '<json settings>'

Started by :class:`rlhf.agent.sandbox.PythonSandbox` in a new session (process group), with
its working directory prepared and a clean environment. Standard library only: nothing of
the project is importable here. Layers, in order (each is applied when the kernel allows it;
which ones were applied is written to ``status_path`` before the code runs):

1. ``PR_SET_PDEATHSIG``: the process dies with the tool worker that started it.
2. ``unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)``: a network namespace with no
   interface up, so no socket reaches anything; a pid namespace whose init runs the code,
   so every process the code starts dies with it; in the user namespace ``RLIMIT_NPROC``
   counts only the sandbox's own processes. As root where user namespaces are refused:
   ``CLONE_NEWNET | CLONE_NEWPID`` when allowed.
3. rlimits: CPU seconds, address space, processes, file size, open files, no core files.
   Outside a user namespace the process limit is set above the user's current task count.
   Root is not bound by ``RLIMIT_NPROC`` at all, so as root a seccomp filter refuses to
   start processes instead (threads still start).
4. Landlock (Linux >= 5.13): writes only beneath the working directory; reads only beneath
   the Python installation, ``/usr``, ``/lib*`` and the working directory; with ABI >= 4 no
   TCP connect / bind; with ABI >= 6 no signals to, or abstract sockets of, processes outside.
5. A Python audit hook refusing writes outside the working directory and socket use: the
   only layer left where the kernel offers none of the above. Code using ctypes or a child
   process gets around it; the layers above it are the real walls.
"""

import ctypes
import json
import os
import resource
import runpy
import signal
import sys
import traceback

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
SYS_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}  # create_ruleset, add_rule, restrict_self
# Landlock filesystem rights by the ABI that introduced them.
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _namespaces(settings: dict) -> list:
    if not settings["use_namespaces"]:
        return []
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0:
        return ["userns", "netns", "pidns"]
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0:
        return ["netns", "pidns"]
    return []


def _own_tasks() -> int:
    """Processes and threads of this real uid (what RLIMIT_NPROC counts outside a user namespace)."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return n


def _run_as_namespace_init(cpu_time_s: int) -> None:
    """In a new pid namespace: fork its init, which runs the code; when init ends, the kernel kills
    every process left in the namespace. This process mirrors init's end and never returns."""
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return
    _, status, usage = os.wait4(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # A namespace's init ignores SIGXCPU; the hard limit's SIGKILL (sent with it) ends it.
        if sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu_time_s:
            sig = signal.SIGXCPU
        if sig != signal.SIGKILL:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status))


def _rlimits(settings: dict, layers: list) -> None:
    cpu = settings["cpu_time_s"]
    mem = settings["memory_mb"] << 20
    nproc = settings["max_processes"]
    if "userns" not in layers:  # the count includes the user's other processes
        nproc += _own_tasks()
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu)), (resource.RLIMIT_AS, (mem, mem)),
                       (resource.RLIMIT_NPROC, (nproc, nproc)),
                       (resource.RLIMIT_FSIZE, (settings["max_file_mb"] << 20,) * 2),
                       (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)


# Classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}.
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_CLONE_THREAD = 0x00010000
# arch: (AUDIT_ARCH, clone, fork / vfork (absent on aarch64), clone3)
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, (57, 58), 435), "aarch64": (0xC00000B7, 220, (), 435)}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_no_processes() -> list:
    """Refuse fork / vfork / clone without CLONE_THREAD (EAGAIN) and clone3 (ENOSYS: libc falls back
    to clone): threads still start, processes do not. Used where RLIMIT_NPROC is void (root)."""
    if os.uname().machine not in _SECCOMP_ARCH:
        return []
    arch, clone, forks, clone3 = _SECCOMP_ARCH[os.uname().machine]
    eagain, enosys = _ERRNO | 11, _ERRNO | 38
    # (code, k, jump-if-true label, jump-if-false label); labels resolve to relative offsets below.
    prog = [(_LD_ABS, 4, None, None), (_JEQ, arch, None, "deny"), (_LD_ABS, 0, None, None),
            (_JGE, 0x40000000, "deny", None),  # x32 system call numbers on x86_64
            (_JEQ, clone3, "enosys", None)] + [(_JEQ, nr, "eagain", None) for nr in forks] + \
        [(_JEQ, clone, None, "allow"), (_LD_ABS, 16, None, None), (_JSET, _CLONE_THREAD, "allow", "eagain"),
         ("allow", _RET, _ALLOW), ("eagain", _RET, eagain), ("enosys", _RET, enosys), ("deny", _RET, _ERRNO | 1)]
    where = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}
    code = []
    for i, ins in enumerate(prog):
        if isinstance(ins[0], str):
            code.append(_SockFilter(ins[1], 0, 0, ins[2]))
            continue
        op, k, jt, jf = ins
        code.append(_SockFilter(op, where[jt] - i - 1 if jt else 0, where[jf] - i - 1 if jf else 0, k))
    arr = (_SockFilter * len(code))(*code)
    fprog = _SockFprog(len(code), arr)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return ["seccomp_no_processes"] if libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0) == 0 else []


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(settings: dict) -> list:
    calls = SYS_LANDLOCK.get(os.uname().machine)
    if calls is None:
        return []
    create, add_rule, restrict = calls
    abi = libc.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return []
    fs = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | \
        (FS_IOCTL_DEV if abi >= 5 else 0)
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    fd = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return []
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    rules = [(settings["workdir"], fs)] + [(p, read) for p in settings["read_paths"]] + \
        [("/dev/null", FS_READ_FILE | FS_WRITE_FILE), ("/dev/urandom", FS_READ_FILE)]
    for path, access in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this machine does not have
        if not os.path.isdir(path):
            access &= FILE_RIGHTS
        rule = _PathBeneath(access & fs, pfd)
        libc.syscall(add_rule, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
        os.close(pfd)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    ok = libc.syscall(restrict, ctypes.c_int(fd), ctypes.c_uint32(0)) == 0
    os.close(fd)
    if not ok:
        return []
    return ["landlock_fs"] + (["landlock_net"] if abi >= 4 else []) + (["landlock_scope"] if abi >= 6 else [])


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                "os.link", "os.symlink", "os.utime", "shutil.rmtree", "shutil.move", "os.mkfifo", "os.mknod"}
_NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo"}


def _audit_hook(workdir: str):
    root = os.path.realpath(workdir) + os.sep

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an fd that was opened (and checked) before
        full = os.path.realpath(os.fsdecode(path))
        return full == "/dev/null" or (full + os.sep).startswith(root)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path}")
        elif event in _PATH_EVENTS:
            if any(isinstance(a, (str, bytes)) and not inside(a) for a in args[:2]):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
        elif event in _NET_EVENTS:
            raise PermissionError("sandbox: network access is disabled")

    return hook


def main() -> None:
    settings = json.loads(sys.argv[1])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    status = open(settings["status_path"], "w")  # before the layers take the right to write it away
    root = os.geteuid() == 0
    layers = _namespaces(settings)
    if "pidns" in layers:
        _run_as_namespace_init(settings["cpu_time_s"])
    _rlimits(settings, layers)
    layers += ["rlimits"] + _landlock(settings)
    if root:  # RLIMIT_NPROC does not bind root (its kernel uid stays 0 in a user namespace)
        layers += _seccomp_no_processes()
    layers += ["audit_hook"]
    json.dump(layers, status)
    status.close()
    workdir = settings["workdir"]
    os.chdir(workdir)
    sys.addaudithook(_audit_hook(workdir))
    sys.argv = ["main.py"]
    sys.path.insert(0, workdir)
    try:
        runpy.run_path("main.py", run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # the program's error, printed without this script's frames
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename not in (__file__, "<frozen runpy>")]
        print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
              + "".join(traceback.format_exception_only(type(e), e)), end="", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
