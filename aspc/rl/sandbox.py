"""The sandbox process of the ToolRunner: a fork server that runs each tool call in a fresh, confined child.

The runner starts one small Python process (`serve`), with none of the runner's environment variables,
and asks it over a unix socket to fork one child per call; the child reports its pid (its own process
group) and then the result on a socket of its own. Forking from this single-threaded server is safe and
fast, where forking the multi-threaded trainer is not; and a child that hangs is killed alone, with its group.

What a call gets. "Namespaces" below needs root, or unprivileged user namespaces (the runner's ids then
map to themselves); `probe` tries every step once in a throw-away child and `ToolRunner.isolation`
reports what works:
  - network (namespaces): a new, empty network namespace: no interface but a downed loopback, so every
    TCP/UDP connection fails, to 127.0.0.1 too, and abstract unix sockets are the namespace's own.
  - processes (namespaces): a new PID namespace, the tool its PID 1 in a process group of its own, with
    a fresh /proc where it sees only its own processes (best effort: a kernel may refuse that mount in a
    user namespace; then it sees the host's pids but cannot signal them). It cannot signal the runner,
    the server or any other call; the timeout kills everything it started, fork bombs included.
  - user: a root runner's tools run as `nobody` (RLIMIT_NPROC then binds; the kernel never applies it
    to root). Other runners' tools keep its user id and lose every capability (in a user namespace they
    would hold all of its own, enough to undo the mounts). PR_SET_NO_NEW_PRIVS: no setuid program helps.
  - filesystem (namespaces, Linux 5.12+), set up after a python tool's module is imported: a mount
    namespace of its own, private to it, in which
      * /tmp and /dev/shm are fresh tmpfs (LIMITS.tmpfs bytes each), empty, the only writable places
        with the scratch folder (inside the fresh /tmp, or its own tmpfs); all of it vanishes with the call;
      * every other mount is read-only and nosuid (mount_setattr, recursive): nothing else is written;
      * /home, /root, $HOME, the runner's working directory, the tool's base_dir and the checkout around
        it (the nearest folder above base_dir with .git or pyproject.toml, else its parent) are covered
        by an empty read-only tmpfs; the system folders (/, /usr, /etc, ...) are never covered;
      * kept readable, read-only: the Python installation (sys.prefix, sys.exec_prefix, sys.base_prefix,
        sys.base_exec_prefix) for the tool's lazy imports, bound back where a cover hides it (the Python
        here lives under /root, a venv in the checkout), and a command tool's base_dir (its scripts). A
        python tool's own folder is not: a module it imports lazily from there fails. So does anything on
        sys.path outside those prefixes in a covered folder (the checkout's own packages).
    A root runner's python tool then needs no capability to read (CAP_DAC_READ_SEARCH is kept only
    without this isolation): /etc/shadow and every root-only file are unreadable.
  - resource limits (always): CPU seconds (timeout + 1), address space, open files, file size, and
    processes (`LIMITS`; for a non-root runner without a user namespace RLIMIT_NPROC counts all of
    the user's tasks, so it is set to the tasks that user has now plus `LIMITS.processes`).
  - environment (always): python and command tools alike see only their declared `env`, PATH and HOME
    (the scratch folder); the server never had the runner's variables, so /proc/self/environ shows none.
  - output (always, in tool_runner): a python tool's prints are kept up to 4 * max_chars characters as
    they come, a command's stdout and stderr likewise; the observation is cut to max_chars.
  - cwd: a fresh scratch folder; the runner removes it after the call.
Without filesystem isolation (no namespaces, an old kernel): a tool writes wherever its user may (for
`nobody`: its scratch folder, the host's /tmp and /dev/shm, where files stay) and reads whatever its user
may; a root runner's python tool reads every file. Without namespaces at all: the host's network, and a
process that leaves the process group outlives the timeout; a non-root runner's tool may signal (kill)
every process of the runner's user, the runner included, and read the other ones' /proc entries.
Never isolated: unix sockets with a path in a folder that is not covered (permissions decide), the
host's kernel (one kernel bug away from everything), and the time and memory of the machine beyond
the limits above (a call's tmpfs counts against the machine's memory, not the tool's address space).
A call whose promised isolation fails to set up does not run (status "crashed").
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
from pathlib import Path

CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWNS = 0x40000000, 0x20000000, 0x10000000, 0x00020000
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
LINUX_CAPABILITY_VERSION_3, CAP_DAC_READ_SEARCH = 0x20080522, 2
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
MNT_DETACH, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE, AT_FDCWD = 0x2, 0x1, 0x2, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # one number on every architecture (Linux 5.12+)
UNPRIVILEGED_USER = "nobody"  # the user a root runner's tools run as; "" keeps root
# never covered, even when the runner's cwd or a tool's folder is one of them: the tools need them
SYSTEM_FOLDERS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin",
                            "/sys", "/usr", "/var"})
PROBE_SCRATCH = "/tmp/aspc-probe-scratch"


class SandboxError(RuntimeError):
    """A call could not be confined as `isolation` promised, so it does not run (status "crashed")."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one tool call, applied with setrlimit in its process before the tool runs."""
    address_space: int = 1 << 30   # bytes: a tool that allocates more gets MemoryError / ENOMEM
    open_files: int = 64
    file_size: int = 64 << 20      # bytes written to any one file
    processes: int = 256           # tasks (processes and threads) of the tool's user id
    tmpfs: int = 64 << 20          # bytes of each fresh tmpfs (/tmp, /dev/shm, a scratch folder outside /tmp)


@dataclass(frozen=True)
class FileSystemPlan:
    """A call's view of the file system, in real paths (filesystem isolation only)."""
    writable: tuple[str, ...]  # each a fresh, empty, size-limited tmpfs, or a folder in one that covers it
    hidden: tuple[str, ...]    # each covered by an empty read-only tmpfs
    kept: tuple[str, ...]      # stay readable (read-only) even where a hidden folder covers them


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
        os.write(write_end, json.dumps(_probe_here()).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        works = json.loads(reader.read() or b"{}")
    return {"network": works.get("network", False), "processes": works.get("network", False),
            "user": works.get("user", False), "resource_limits": True, "filesystem": works.get("filesystem", False)}


def _probe_here() -> dict[str, bool]:
    """In the throw-away child: a call's steps, then a check that the file-system view really holds."""
    namespaces = _enter_namespaces()
    mounted = namespaces and _isolates(_probe_plan())
    user = _drop_privileges(keep_reading=not mounted)
    unprivileged = user or _drop_all_capabilities()
    return {"network": namespaces, "user": user, "filesystem": mounted and unprivileged and _filesystem_holds()}


def _isolates(plan: FileSystemPlan) -> bool:
    try:
        _isolate_filesystem(plan, mount_proc=False)
    except SandboxError:
        return False
    return True


def _probe_plan() -> FileSystemPlan:
    hidden = _hidden_folders(os.getcwd(), os.path.expanduser("~"), None)
    return FileSystemPlan(writable=("/tmp", "/dev/shm", PROBE_SCRATCH), hidden=hidden, kept=_python_folders())


def _filesystem_holds() -> bool:
    """As the tool will be: an empty /tmp it may write, a read-only rest, the stdlib readable, and no
    way to take a covering mount away."""
    try:
        fresh_tmp = os.listdir("/tmp") == [os.path.basename(PROBE_SCRATCH)]
        with open("/tmp/aspc-probe-written", "w") as written:
            written.write("x")
        with open(os.__file__, "rb") as stdlib:
            stdlib_readable = bool(stdlib.read(1))
    except OSError:
        return False
    cover_stays = _libc.umount2(b"/tmp", MNT_DETACH) != 0
    return fresh_tmp and stdlib_readable and not _can_write("/etc/aspc-probe") and cover_stays


def _can_write(path: str) -> bool:
    try:
        with open(path, "w"):
            pass
    except OSError:
        return False
    os.remove(path)
    return True


def _serve_call(channel: socket.socket, isolation: dict[str, bool], run_call) -> None:
    """In the forked child: own process group, report the pid, read the request, run it confined."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)  # the runner kills the whole group at the timeout
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the server gone (runner closed): stop too
    channel.sendall(f"{os.getpid()}\n".encode())
    request = json.loads(_read_all(channel))
    if isolation["network"]:
        _enter_namespaces()
        if os.fork() != 0:  # this process waits; the tool runs as PID 1 of the new namespace
            channel.close()
            os.wait()
            os._exit(0)
        # a group of its own, so that kill(0) or killpg cannot reach the waiter; the runner's kill of the
        # waiter's group at the timeout still ends the tool (parent-death signal) and its whole namespace
        os.setpgid(0, 0)
    confine = _confiner(request, isolation, fresh_task_count=isolation["network"] or os.geteuid() == 0)
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


def _confiner(request: dict, isolation: dict[str, bool], fresh_task_count: bool) -> Callable[[], None]:
    """Limits now; the file-system view and the privilege drop later, by the caller, once the tool's
    module is imported (from the tool's folder, which is then hidden)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _set_limits(request["cpu_seconds"], fresh_task_count)
    os.chdir(request["scratch"])

    def confine() -> None:
        if isolation["filesystem"]:
            _isolate_filesystem(filesystem_plan(request), mount_proc=isolation["processes"])
            os.chdir(request["scratch"])  # the fresh folder now mounted there, not the one beneath it
        _become_unprivileged(request, isolation)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid program gives the rights back
    return confine


def _become_unprivileged(request: dict, isolation: dict[str, bool]) -> None:
    """nobody for a root runner; otherwise no capabilities (a user namespace gave the tool all of its own)."""
    if not isolation["user"]:
        if not _drop_all_capabilities():
            raise SandboxError("cannot drop the capabilities of the tool's process")
        return
    user = pwd.getpwnam(UNPRIVILEGED_USER)
    os.chown(request["scratch"], user.pw_uid, user.pw_gid)
    keep_reading = bool(request["python"]) and not isolation["filesystem"]
    if not _drop_privileges(keep_reading):
        raise SandboxError(f"cannot become the user {UNPRIVILEGED_USER}")
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of user clears it


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


def _enter_namespaces() -> bool:
    """New network and PID namespaces (and the user namespace a non-root runner needs for them)."""
    uid, gid = os.getuid(), os.getgid()
    flags = _namespace_flags()
    if not _unshare(flags):
        return False
    if flags & CLONE_NEWUSER:
        _map_own_ids(uid, gid)
    return True


def _map_own_ids(uid: int, gid: int) -> None:
    """The runner's ids map to themselves, so that what the tool writes keeps its owner; unmapped, the
    tool would be the overflow id, unable to create a file, and the probe reports `filesystem` False."""
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    except OSError:
        pass


def _unshare(flags: int) -> bool:
    return _libc.unshare(flags) == 0


# ---- the file-system view of a call (a mount namespace of its own) --------------------------------

def filesystem_plan(request: dict) -> FileSystemPlan:
    """Fresh /tmp, /dev/shm and scratch; homes and the checkout hidden; the Python installation kept,
    and a command tool's folder (its scripts), but not a python tool's: its module is already imported."""
    base_dir = request["base_dir"]
    kept = _python_folders() + ((os.path.realpath(base_dir),) if base_dir and not request["python"] else ())
    hidden = _hidden_folders(request["cwd"], request["home"], base_dir)
    return FileSystemPlan(writable=("/tmp", "/dev/shm", os.path.realpath(request["scratch"])), hidden=hidden,
                          kept=kept)


def _hidden_folders(cwd: str, home: str, base_dir: str | None) -> tuple[str, ...]:
    """The homes, the runner's working directory, and the tool's folder with the checkout around it."""
    candidates = ["/home", "/root", home, cwd]
    if base_dir:
        candidates += [base_dir, _checkout_of(base_dir)]
    real = {os.path.realpath(path) for path in candidates if path}
    return tuple(sorted(path for path in real if path not in SYSTEM_FOLDERS and os.path.isdir(path)))


def _checkout_of(folder: str) -> str:
    """The nearest folder above `folder` that holds .git or pyproject.toml; else its parent."""
    resolved = Path(folder).resolve()
    for parent in resolved.parents:
        if (parent / ".git").exists() or (parent / "pyproject.toml").exists():
            return str(parent)
    return str(resolved.parent)


def _python_folders() -> tuple[str, ...]:
    """The interpreter's installation (stdlib, lib-dynload, site-packages): the tool's lazy imports."""
    prefixes = (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)
    return tuple(sorted({os.path.realpath(prefix) for prefix in prefixes}))


def _isolate_filesystem(plan: FileSystemPlan, mount_proc: bool) -> None:
    """Enter a mount namespace of its own and build the plan's view there; SandboxError if a step fails
    (then the call does not run: nothing was mounted where the host sees it)."""
    if not _unshare(CLONE_NEWNS):
        raise SandboxError("cannot isolate the file system: unshare(CLONE_NEWNS) failed")
    try:
        _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below reaches the host
        originals = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in _outermost(plan.kept)
                     if os.path.isdir(path)}
        covered = _cover(plan)
        _bind_back(originals, covered)
        if mount_proc:
            _mount_fresh_proc()
        _set_mount_attributes("/", attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, recursive=True)
        for path in (path for path, writable in covered.items() if writable):
            _set_mount_attributes(path, attr_clr=MOUNT_ATTR_RDONLY)
    except OSError as error:
        raise SandboxError(f"cannot isolate the file system: {error}") from None


def _outermost(paths: tuple[str, ...]) -> list[str]:
    """The paths that no other one contains (binding a folder back brings what is inside it)."""
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda path: Path(path).parts):
        if _covering(path, kept) is None and path not in kept:
            kept.append(path)
    return kept


def _cover(plan: FileSystemPlan) -> dict[str, bool]:
    """Mount the plan's tmpfs, outer folders first: {mounted path: writable}. A writable folder inside a
    writable tmpfs is only made there (the scratch folder in the fresh /tmp shares its size); a hidden
    one inside any covered folder is hidden already."""
    wanted = {**{path: False for path in plan.hidden}, **{path: True for path in plan.writable}}
    covered: dict[str, bool] = {}
    for path in sorted(wanted, key=lambda path: Path(path).parts):
        above = _covering(path, covered)
        if above is not None and (covered[above] or not wanted[path]):
            if wanted[path]:
                os.makedirs(path, exist_ok=True)
            continue
        if above is not None:
            os.makedirs(path, exist_ok=True)  # a scratch folder inside a hidden one gets its own tmpfs
        elif not os.path.isdir(path):
            continue
        _mount_tmpfs(path, writable=wanted[path])
        covered[path] = wanted[path]
    return covered


def _covering(path: str, folders) -> str | None:
    """The innermost of `folders` strictly above `path`."""
    above = [folder for folder in folders if path.startswith(folder.rstrip("/") + "/")]
    return max(above, key=len, default=None)


def _mount_tmpfs(path: str, writable: bool) -> None:
    size, mode = (LIMITS.tmpfs, "1777") if writable else (1 << 20, "0755")
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


def _bind_back(originals: dict[str, int], covered: dict[str, bool]) -> None:
    """Each kept folder that a tmpfs now covers is bound back at its own path, from a descriptor opened
    before the covering (the folder itself is still there, under the tmpfs)."""
    for path, descriptor in originals.items():
        if path in covered or _covering(path, covered) is not None:
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{descriptor}", path, None, MS_BIND | MS_REC)
        os.close(descriptor)


def _mount_fresh_proc() -> None:
    """/proc of the tool's own PID namespace: it sees (and can signal) only its own processes. Best effort:
    a kernel refuses it in a user namespace when parts of the host's /proc are covered (containers)."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if text is None else text.encode() for text in (source, target, fstype, data)]
    if _libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]) != 0:
        raise _os_error(f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _set_mount_attributes(path: str, attr_set: int = 0, attr_clr: int = 0, recursive: bool = False) -> None:
    """mount_setattr(2): one call makes the whole tree read-only, which no loop of remounts does atomically."""
    attributes = _MountAttr(attr_set, attr_clr, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    if _libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(AT_FDCWD), path.encode(), ctypes.c_uint(flags),
                     ctypes.byref(attributes), ctypes.c_size_t(ctypes.sizeof(attributes))) != 0:
        raise _os_error(f"mount_setattr {path}")


def _os_error(what: str) -> OSError:
    number = ctypes.get_errno()
    return OSError(number, f"{what}: {os.strerror(number)}")


# ---- the tool's user and capabilities --------------------------------------------------------------

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


def _drop_all_capabilities() -> bool:
    """None left: a tool in a user namespace of its own would otherwise hold every capability there,
    enough to unmount what hides the host's files."""
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    return _libc.capset(header, (ctypes.c_uint32 * 6)()) == 0


def start_command(control_fd: int) -> list[str]:
    """The command line that starts `serve` in a fresh interpreter with the runner's module path."""
    code = ("import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
            "from aspc.rl.tool_runner import serve_tools; serve_tools(int(sys.argv[1]))")
    return [sys.executable, "-c", code, str(control_fd), json.dumps(sys.path)]
