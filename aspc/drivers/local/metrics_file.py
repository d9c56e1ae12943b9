"""The per-step metrics file (JSON lines), safe to append to across crashes and resumes.

Nothing is touched until the run has built and is about to train, so a run that fails to start
leaves an existing file as it was. A fresh run into an existing, non-empty file moves that file
aside (`metrics.jsonl` -> `metrics.1.jsonl`, the next free number) instead of overwriting it. A
resumed run keeps the rows up to the checkpoint it resumed from and drops the later ones (those
steps are trained again), so every step has exactly one row. A line torn by a kill is dropped.

A write that fails (full disk, `ulimit -f`, a read-only folder, a folder where the file should be)
raises OSError naming the file; `check_can_write` finds the last three before a run trains.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path


class MetricsFile:
    def __init__(self, path: Path | None, resume_version: int | None):
        """`resume_version`: the step a resumed run continues after; None for a fresh run."""
        self.path, self.resume_version = path, resume_version

    def open(self) -> str | None:
        """Prepare the file for appending; returns a note for the user when an old file was moved."""
        if self.path is None:
            return None
        with _naming(self.path):
            return self._open(self.path)

    def _open(self, path: Path) -> str | None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_version is not None:
            _keep_through(path, self.resume_version)
            return None
        if path.exists() and path.stat().st_size > 0:
            aside = _free_name(path)
            os.replace(path, aside)
            return f"the previous metrics in {path} were moved to {aside}"
        return None

    def append(self, row: dict) -> None:
        """One row, on a line of its own even after a torn line, written whole or (after a kill)
        not at all as far as readers go (hold Ctrl-C around it with `interrupts_held`)."""
        if self.path is None:
            return
        line = (json.dumps(row) + "\n").encode("utf-8")
        with _naming(self.path), open(self.path, "ab+") as out:
            if out.seek(0, os.SEEK_END) and _last_byte(out) != b"\n":
                line = b"\n" + line
            out.write(line)
            out.flush()


def _keep_through(path: Path, version: int) -> None:
    """Drop the rows after step `version` (a resumed run writes them again)."""
    rows = [r for r in read_rows(path) if r.get("step", 0) <= version]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def check_can_write(path: Path) -> None:
    """Raise OSError naming `path` if a file cannot be written there: its folder cannot be made or
    written (read-only, under a file, /proc), or `path` is a folder. It makes the folder and leaves
    an existing file as it was."""
    with _naming(path):
        if path.is_dir():
            raise OSError(errno.EISDIR, "a folder is there, not a file")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
        if path.exists():
            open(path, "ab").close()


@contextmanager
def _naming(path: Path):
    """An OSError inside as one naming `path` (a failed write() names no file)."""
    try:
        yield
    except OSError as error:
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None


def read_rows(path: Path) -> list[dict]:
    """The complete rows of a metrics file (a torn last line is skipped); [] if there is none."""
    if path is None or not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _last_byte(file) -> bytes:
    file.seek(-1, os.SEEK_END)
    return file.read(1)


@contextmanager
def interrupts_held():
    """Block SIGINT on this thread while inside (it is delivered on leaving)."""
    can_block = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    if can_block:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if can_block:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _free_name(path: Path) -> Path:
    number = 1
    while (candidate := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists():
        number += 1
    return candidate
