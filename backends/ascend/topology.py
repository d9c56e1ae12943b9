"""Where pool devices are: pools are laid out node by node (8 NPUs per Atlas 800T A2 node),
in the order the plan lists them."""
from __future__ import annotations

from dataclasses import dataclass

NPUS_PER_NODE = 8


@dataclass(frozen=True)
class Device:
    global_index: int  # across the whole cluster
    node: int
    local: int  # index on its node: what ASCEND_RT_VISIBLE_DEVICES names


def pool_offsets(pools) -> dict[str, int]:
    """First global device of each pool; each pool starts on a fresh node."""
    offsets, next_free = {}, 0
    for pool in pools:
        offsets[pool.name] = next_free
        next_free += -(-pool.count // NPUS_PER_NODE) * NPUS_PER_NODE
    return offsets


def device(pool_offset: int, index: int) -> Device:
    g = pool_offset + index
    return Device(g, g // NPUS_PER_NODE, g % NPUS_PER_NODE)


def visible_devices(devices: list[Device]) -> str:
    """ASCEND_RT_VISIBLE_DEVICES: comma-separated, ascending."""
    return ",".join(str(d.local) for d in sorted(devices, key=lambda d: d.local))
