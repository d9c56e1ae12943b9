"""How many intra-op threads each worker's torch may use.

Every worker thread (a generation instance, the learner) computes with torch; left at torch's
default each spawns a thread per core, so three workers on two cores run six busy threads and a
loaded machine slows down 7-13x. Each worker gets an equal share of the cores this process may
run on (at least one). `ASPC_TORCH_THREADS=N` (or `aspc run --threads N`) overrides the share.
"""
from __future__ import annotations

import os

ENV = "ASPC_TORCH_THREADS"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int, override: int | None = None) -> int:
    """Threads for each of `workers` concurrent workers: the override, $ASPC_TORCH_THREADS, or a
    fair share of the available cores."""
    if override is None and os.environ.get(ENV, "").strip():
        try:
            override = int(os.environ[ENV])
        except ValueError:
            raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a whole number of threads") from None
    if override is not None:
        if override < 1:
            raise ValueError(f"the torch thread count must be at least 1, not {override}")
        return override
    return max(1, available_cores() // max(1, workers))
