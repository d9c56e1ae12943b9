"""Set the calling thread's torch intra-op thread count (OpenMP's count is per thread)."""
from __future__ import annotations

import torch


def use_threads(count: int) -> int:
    """Returns the count now in force on this thread."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return torch.get_num_threads()
