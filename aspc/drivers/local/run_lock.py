"""One run per folder: a run's metrics and checkpoint folders are locked while it trains.

Two runs writing one folder interleave their metrics rows and overwrite each other's checkpoints
(two fresh runs a second apart both exited 0 with 148 duplicated steps; two `--resume` runs raced).
A lock is a file, `LOCK_NAME`, made with O_CREAT | O_EXCL in the folder: it holds the owner's pid,
the kernel's start time of that process (so a reused pid is not taken for the owner) and the host.
A lock whose owner is gone (killed with SIGKILL, the machine restarted) is stale: it is taken over,
and the run says so. A lock of another host cannot be checked from here: the run is refused, and the
message says which file to remove once that run is known to be over.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".aspc-run.lock"


class FolderInUse(Exception):
    """Another run holds the folder; the message says which and what to do."""


@dataclass(frozen=True)
class Owner:
    pid: int
    started: str  # the process's start time in clock ticks since boot (/proc/PID/stat field 22)
    host: str

    @staticmethod
    def me() -> Owner:
        return Owner(os.getpid(), _start_time(os.getpid()), socket.gethostname())

    def alive(self) -> bool:
        """Still running (on this host; another host's owner is taken as alive: it cannot be checked)."""
        if self.host != socket.gethostname():
            return True
        return _start_time(self.pid) == self.started


class RunLock:
    """The locks of a run's folders, taken together or not at all; release() drops them."""

    def __init__(self, folders: list[Path]):
        self.paths = [Path(f) / LOCK_NAME for f in dict.fromkeys(Path(f).resolve() for f in folders)]
        self.held: list[Path] = []
        self.notes: list[str] = []  # stale locks taken over, for the user

    def acquire(self) -> RunLock:
        try:
            for path in self.paths:
                self._take(path)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        me = Owner.me()
        for path in self.held:
            if _read(path) == me:  # never remove a lock that another run took over meanwhile
                path.unlink(missing_ok=True)
        self.held = []

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _take(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):  # a stale lock removed by two runs at once: one of them wins the O_EXCL
            if _create(path):
                self.held.append(path)
                return
            owner = _read(path)
            if owner is not None and owner.alive():
                raise FolderInUse(_in_use(path, owner))
            self.notes.append(f"took over the stale lock {path}" + (f" of pid {owner.pid}, which is gone"
                                                                    if owner else " (unreadable)"))
            path.unlink(missing_ok=True)
        raise FolderInUse(f"{path.parent} is being locked by other runs at this moment; try again")


def _create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        owner = Owner.me()
        json.dump({"pid": owner.pid, "started": owner.started, "host": owner.host}, file)
    return True


def _read(path: Path) -> Owner | None:
    try:
        fields = json.loads(path.read_text())
        return Owner(int(fields["pid"]), str(fields["started"]), str(fields["host"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # gone meanwhile, or torn by a kill while it was written: stale


def _start_time(pid: int) -> str:
    """The kernel's start time of the process (empty if there is no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # after the command's name, which may hold spaces


def _in_use(path: Path, owner: Owner) -> str:
    where = f"pid {owner.pid}" + ("" if owner.host == socket.gethostname() else f" on host {owner.host}")
    remove = "" if owner.host == socket.gethostname() else \
        f"; if that run is over, remove {path}"
    return (f"{path.parent} is in use by another aspc run ({where}): two runs in one folder would mix "
            f"their metrics and checkpoints. Wait for it to end, or give this run another folder "
            f"(--metrics, --checkpoint){remove}")
