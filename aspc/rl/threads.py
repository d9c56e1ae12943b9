"""Set the calling thread's torch intra-op thread count (OpenMP's count is per thread), and make a
fresh worker process ready to compute."""
from __future__ import annotations

import importlib

import torch


def use_threads(count: int) -> int:
    """Returns the count now in force on this thread. In a fresh process (a process worker, a Ray
    actor) it also imports what torch otherwise imports at the first optimizer step (torch._dynamo,
    about a second), so that the cost falls before the run's clock starts, not inside a step."""
    importlib.import_module("torch._dynamo")
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return torch.get_num_threads()
