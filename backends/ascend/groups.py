"""Megatron-style rank layout of one stage: ranks ordered tp fastest, then cp, then dp, then pp
(megatron-core's default order "tp-cp-ep-dp-pp"), and the process groups that follow."""
from __future__ import annotations

from aspc.ir.graph import Parallel


def rank_coords(par: Parallel) -> list[dict[str, int]]:
    """Coordinates (tp, cp, dp, pp) of each rank, in rank order."""
    coords = []
    for pp in range(par.pp):
        for dp in range(par.dp):
            for cp in range(par.cp):
                for tp in range(par.tp):
                    coords.append({"tp": tp, "cp": cp, "dp": dp, "pp": pp})
    return coords


def process_groups(par: Parallel) -> dict[str, list[list[int]]]:
    """Ranks of every tp, cp, dp, pp and ep group (expert parallelism spans dp x cp ranks of a
    tp position, in groups of ep)."""
    coords = rank_coords(par)
    groups: dict[str, list[list[int]]] = {}
    for axis in ("tp", "cp", "dp", "pp"):
        others = [a for a in ("tp", "cp", "dp", "pp") if a != axis]
        buckets: dict[tuple, list[int]] = {}
        for rank, c in enumerate(coords):
            buckets.setdefault(tuple(c[a] for a in others), []).append(rank)
        groups[axis] = sorted(buckets.values())
    if par.ep > 1:
        groups["ep"] = [group for dp_cp in _dp_cp_groups(coords) for group in _chunks(dp_cp, par.ep)]
    return groups


def _dp_cp_groups(coords) -> list[list[int]]:
    buckets: dict[tuple, list[int]] = {}
    for rank, c in enumerate(coords):
        buckets.setdefault((c["tp"], c["pp"]), []).append(rank)
    return sorted(buckets.values())


def _chunks(ranks: list[int], size: int) -> list[list[int]]:
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]
