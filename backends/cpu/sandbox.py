"""The sandbox process of the ToolRunner: a fork server that runs each tool call in a fresh, confined child.

The runner starts one small Python process (`serve`) that imports nothing heavy, and asks it over a
unix socket to fork one child per call; the child reports its pid (its own process group) and then
the result on a socket of its own. Forking from this single-threaded server is safe and fast, where
forking the multi-threaded trainer is not; and a child that hangs is killed alone, with its group.

What a child does before it runs the tool (each step only where the machine allows it; `probe`
finds out once, and `ToolRunner.isolation` reports the answer):
  - network: a new, empty network namespace (`unshare(CLONE_NEWNET)`): no interface but a downed
    loopback, so every connection fails. Needs root, or unprivileged user namespaces.
  - processes: a new PID namespace: the tool runs as its PID 1, and when the runner kills it at the
    timeout the kernel kills every process it started, even one that left the process group.
  - user: when the runner is root, the tool runs as `nobody`, so it can write only where anyone may
    (its scratch folder, /tmp), and RLIMIT_NPROC binds (the kernel never applies it to root). A python
    tool's module is imported as root first, and the tool keeps one capability, CAP_DAC_READ_SEARCH:
    it may read any file (so its own imports work from a Python under /root) but not write one.
    A command loses every capability: a script `nobody` cannot read (in a 0700 folder) fails to run.
    A non-root runner's tools keep its user id.
  - resource limits (always): CPU seconds (timeout + 1), address space, open files, file size, and
    processes (`LIMITS`; for a non-root runner without a user namespace RLIMIT_NPROC counts all of
    the user's tasks, so it is set to the tasks that user has now plus `LIMITS.processes`).
  - cwd: a fresh scratch folder, removed after the call (a command tool's HOME too).
Not isolated: the file system. There is no mount namespace or chroot: a tool writes wherever its
user may (for `nobody`: its scratch folder, /tmp, /dev/shm) and reads whatever its user may; a
python tool of a root runner may read every file, secrets included. Only a command tool gets a clean
environment (the declared variables, PATH, HOME); a python tool sees the runner's environment.
Without a PID namespace, a process that leaves the process group outlives the timeout.
"""
from __future__ import annotations

import ctypes
import json
import os
import pwd
import resource
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x40000000, 0x20000000, 0x10000000
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS = 1, 8
LINUX_CAPABILITY_VERSION_3, CAP_DAC_READ_SEARCH = 0x20080522, 2
UNPRIVILEGED_USER = "nobody"  # the user a root runner's tools run as; "" keeps root


@dataclass(frozen=True)
class Limits:
    """Resource limits of one tool call, applied with setrlimit in its process before the tool runs."""
    address_space: int = 1 << 30   # bytes: a tool that allocates more gets MemoryError / ENOMEM
    open_files: int = 64
    file_size: int = 64 << 20      # bytes written to any one file
    processes: int = 256           # tasks (processes and threads) of the tool's user id


LIMITS = Limits()
_libc = ctypes.CDLL(None, use_errno=True)


def serve(control_fd: int, run_call: Callable[[dict, Callable[[], None]], dict]) -> None:
    """The fork server's loop: one child per call until the runner closes the control socket."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished children
    control = socket.socket(fileno=control_fd)
    isolation = probe()
    control.send(json.dumps(isolation).encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 16, 1)
        except OSError:
            return
        if not message or not fds:
            return
        if os.fork() == 0:
            control.close()
            _serve_call(socket.socket(fileno=fds[0]), isolation, run_call)
        os.close(fds[0])


def probe() -> dict[str, bool]:
    """Which protections work here: tried in a throw-away child, since unshare cannot be undone."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.close(read_end)
        works = {"network": _unshare(_namespace_flags()), "user": _drop_privileges(keep_reading=True)}
        os.write(write_end, json.dumps(works).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        works = json.loads(reader.read() or b"{}")
    return {"network": works.get("network", False), "processes": works.get("network", False),
            "user": works.get("user", False), "resource_limits": True, "filesystem": False}


def _serve_call(channel: socket.socket, isolation: dict[str, bool], run_call) -> None:
    """In the forked child: own process group, report the pid, read the request, run it confined."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)  # the runner kills the whole group at the timeout
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the server gone (runner closed): stop too
    channel.sendall(f"{os.getpid()}\n".encode())
    request = json.loads(_read_all(channel))
    if isolation["network"]:
        _unshare(_namespace_flags())
        if os.fork() != 0:  # this process waits; the tool runs as PID 1 of the new namespace
            channel.close()
            os.wait()
            os._exit(0)
    confine = _confiner(request, isolation["user"], fresh_task_count=isolation["network"] or os.geteuid() == 0)
    tool_process = os.getpid()
    reply = run_call(request, confine)
    if os.getpid() != tool_process:  # a process the tool forked returned here: only the tool replies
        os._exit(0)
    channel.sendall(json.dumps(reply).encode())
    os._exit(0)


def _read_all(channel: socket.socket) -> bytes:
    chunks = []
    while chunk := channel.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _confiner(request: dict, unprivileged: bool, fresh_task_count: bool) -> Callable[[], None]:
    """Limits now; the privilege drop later, by the caller, once the tool's module is imported."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _set_limits(request["cpu_seconds"], fresh_task_count)
    os.chdir(request["scratch"])

    def drop() -> None:
        if unprivileged:
            user = pwd.getpwnam(UNPRIVILEGED_USER)
            os.chown(request["scratch"], user.pw_uid, user.pw_gid)
            _drop_privileges(keep_reading=bool(request["python"]))
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of user clears it
    return drop


def _set_limits(cpu_seconds: int, fresh_task_count: bool) -> None:
    """fresh_task_count: the tool's user id (nobody, or a new user namespace's) counts only its tasks;
    root, if the tool keeps it, is never held to RLIMIT_NPROC by the kernel."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (LIMITS.address_space, LIMITS.address_space))
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMITS.open_files, LIMITS.open_files))
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMITS.file_size, LIMITS.file_size))
    tasks = LIMITS.processes if fresh_task_count else _tasks_of(os.getuid()) + LIMITS.processes
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))


def _will_drop_to_other_user() -> bool:
    return os.geteuid() == 0 and bool(UNPRIVILEGED_USER)


def _tasks_of(uid: int) -> int:
    """The tasks (threads included) that RLIMIT_NPROC already counts for this user."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = open(f"/proc/{entry.name}/status").read()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            count += int(fields["Threads"]) if fields["Uid"].split()[0] == str(uid) else 0
    return count


def _namespace_flags() -> int:
    """A non-root runner needs a user namespace to be allowed to make the others."""
    return CLONE_NEWNET | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)


def _unshare(flags: int) -> bool:
    return _libc.unshare(flags) == 0


def _drop_privileges(keep_reading: bool) -> bool:
    """Become UNPRIVILEGED_USER (a root runner only), keeping the right to read any file if asked."""
    if not _will_drop_to_other_user():
        return False
    try:
        user = pwd.getpwnam(UNPRIVILEGED_USER)
        _libc.prctl(PR_SET_KEEPCAPS, int(keep_reading))
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
    except (KeyError, OSError):
        return False
    return not keep_reading or _keep_only_read_capability()


def _keep_only_read_capability() -> bool:
    """CAP_DAC_READ_SEARCH alone: the tool reads what root could (its own lazy imports from a Python
    under /root still work) but writes only as nobody; execve drops it again for nobody's programs."""
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    read_only = 1 << CAP_DAC_READ_SEARCH
    effective_permitted_inheritable = (ctypes.c_uint32 * 6)(read_only, read_only, 0, 0, 0, 0)
    return _libc.capset(header, effective_permitted_inheritable) == 0


def start_command(control_fd: int) -> list[str]:
    """The command line that starts `serve` in a fresh interpreter with the runner's module path."""
    code = ("import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
            "from aspc.backends.cpu.tool_runner import serve_tools; serve_tools(int(sys.argv[1]))")
    return [sys.executable, "-c", code, str(control_fd), json.dumps(sys.path)]
