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
    """First global device of each pool: pools that fit in what is left of the current node share it
    (a node of 8 NPUs runs a 4-NPU trainer beside a 4-NPU engine pool, on one runtime node); a pool
    that does not fit starts on a fresh node, so that no pool crosses a node boundary it need not."""
    offsets, next_free = {}, 0
    for pool in pools:
        left = -next_free % NPUS_PER_NODE
        if pool.count > left:
            next_free += left
        offsets[pool.name] = next_free
        next_free += pool.count
    return offsets


def device(pool_offset: int, index: int) -> Device:
    g = pool_offset + index
    return Device(g, g // NPUS_PER_NODE, g % NPUS_PER_NODE)


def visible_devices(devices: list[Device]) -> str:
    """ASCEND_RT_VISIBLE_DEVICES: comma-separated, ascending."""
    return ",".join(str(d.local) for d in sorted(devices, key=lambda d: d.local))
