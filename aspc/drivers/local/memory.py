"""Hand the C heap's free pages back to the operating system (glibc's `malloc_trim`).

A model's weights are a few hundred tensors of 0.1–5 MB each. glibc serves such sizes from its
heaps once its mmap threshold has risen (it follows the largest freed block, up to 32 MB), and
pages freed there stay resident: the driver of a SmolLM2 run held 10.3 GB after two steps with 2 GB
of live tensors, 5.5 GB once trimmed. The runtime trims once, after a held-out evaluation (its copy
of the model and its KV cache are gone then, and nothing reuses those pages soon). Not during the
steps: trimming after each step (driver, an engine's refresh, the learner's snapshot) lowered the
processes' resident memory between steps but made every later allocation fault its pages in anew,
and the steps of a 50-step sync run were about 25% slower with it (reverted); a fixed low mmap
threshold slowed the learner's pass by 20–30% the same way. Elsewhere (no glibc) it does nothing.
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
