"""Whether a Ctrl-C (SIGINT) reached this process: the `aspc` console script's SIGINT handler notes
it, so that an error raised after it (a call the interrupt cut in half, an import it broke) is
told apart from an error of its own and ends as the interruption it is (aspc/cli/main.py entry,
aspc/cli/run.py)."""
from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass
class _Interrupts:
    seen: bool = False  # a SIGINT reached this process
    sigterm: bool = False  # ... raised by `aspc run`'s SIGTERM handler (run.py): the stop was a SIGTERM


_interrupts = _Interrupts()


def note_interrupt(signum, frame) -> None:
    """Python's own Ctrl-C handler (KeyboardInterrupt), remembering that it ran."""
    _interrupts.seen = True
    signal.default_int_handler(signum, frame)


def note_sigterm() -> None:
    """The SIGINT about to be raised stands for a SIGTERM."""
    _interrupts.sigterm = True


def interrupt_seen() -> bool:
    return _interrupts.seen


def stop_cause() -> tuple[str, int]:
    """What stopped the process, in words, and its exit code (128 + the signal, the shell's convention)."""
    return ("SIGTERM", 143) if _interrupts.sigterm else ("Ctrl-C", 130)
