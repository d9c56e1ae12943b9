"""Hand the C heap's free pages back to the operating system (glibc's `malloc_trim`).

A model's weights are a few hundred tensors of 0.1–5 MB each. glibc serves such sizes from its
heaps once its mmap threshold has risen (it follows the largest freed block, up to 32 MB), and a
published version freed later leaves its pages in the heap: the driver of a SmolLM2 run held
10.3 GB after two steps with 2 GB of live tensors, 5.5 GB once trimmed. Setting a fixed low mmap
threshold instead gave the same back but slowed the learner's pass by 20–30% (every activation
a fresh mmap, its pages faulted in anew), so the runtime trims at points where a version has just
been dropped or handed over: once a step in the driver, after a weight refresh in a generation
process, after the learner's snapshot. Elsewhere (no glibc) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


def release_free_memory() -> None:
    """Return the heap's free pages to the OS (a few milliseconds for a few GB of heap)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
