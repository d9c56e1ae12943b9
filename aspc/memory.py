"""Memory housekeeping shared by the layers that build large object graphs in one go (the front
end compiling a file, the simulator running a plan)."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Pause Python's cyclic garbage collector inside: code that makes hundreds of thousands of
    small objects and no reference cycles has them rescanned again and again otherwise (a third of
    compiling a 2 MB file; about 12% of simulating r1_zero_671b for 20 steps). Refcounting still
    frees everything; the collector runs again after. What is still alive then (a simulation's
    result, a compiled plan) moves to the oldest generation at once (freeze, unfreeze: no scan):
    left in the youngest, the first collection after would scan every object made inside."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
