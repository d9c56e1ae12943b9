"""A layout: how many devices each pool has and how every device-backed stage sits on them.

`auto-place` (passes/auto_place.py) chooses one and applies it to the stage graph with
`apply_layout`; `aspc tune` writes the same choice back as source (aspc/frontend/layouts.py).
Plain records, so the front end, the passes and the CLI share them without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from aspc.ir.graph import Parallel, PoolSpec, StageGraph


class LayoutError(ValueError):
    """A program automatic placement cannot lay out; `where` names the stage or pool at fault (None:
    the program as a whole)."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class StageLayout:
    stage: str
    pool: str
    instances: int
    parallel: Parallel


@dataclass(frozen=True)
class Layout:
    """Pool sizes (a pool left out is dropped: its stages moved) and each stage's placement."""

    pools: tuple[tuple[str, int], ...]
    stages: tuple[StageLayout, ...]

    def stage(self, name: str) -> StageLayout | None:
        return next((s for s in self.stages if s.stage == name), None)

    def describe(self) -> str:
        """One line: `rollout 4 + learner 12: gen 1x(tp=4) | update dp=3 tp=4 | ...`."""
        pools = " + ".join(f"{name} {count}" for name, count in self.pools)
        return f"{pools}: " + " | ".join(_stage_text(s) for s in self.stages)


@dataclass(frozen=True)
class Knobs:
    """The schedule's settings `auto-place` may choose beside the layout (asp): the staleness bound,
    the micro-batch token budget (`pack`) and the static shape buckets. None: not searched."""

    staleness: int | None = None
    pack: int | None = None
    buckets: int | None = None

    def options(self) -> dict[str, int]:
        """The searched settings as schedule options."""
        return {k: v for k, v in (("staleness", self.staleness), ("pack", self.pack), ("buckets", self.buckets))
                if v is not None}

    def describe(self) -> str:
        """`staleness=2 pack=16384 buckets=2`, or "" when nothing was searched."""
        return " ".join(f"{k}={v}" for k, v in self.options().items())


def _stage_text(s: StageLayout) -> str:
    p = s.parallel
    shape = " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "pp", "dp", "cp", "ep")
                     if getattr(p, k) != 1 or k == "tp")
    where = f"{s.instances}x({shape})" if s.instances > 1 else shape
    return f"{s.stage} {where} on {s.pool}"


def apply_layout(graph: StageGraph, layout: Layout) -> StageGraph:
    """The graph with the layout's pool sizes and stage placements (pass results kept)."""
    sizes, hardware = dict(layout.pools), next(iter(graph.pools.values())).hardware
    pools = [replace(p, count=sizes[p.name]) if p.name in sizes else p for p in graph.pools.values()
             if p.name in sizes or _used(graph, layout, p.name)]
    pools += [PoolSpec(name, hardware, count) for name, count in layout.pools if name not in graph.pools]
    stages = []
    for stage in graph.stages():
        placed = layout.stage(stage.name)
        if placed is not None:
            stage = replace(stage, pool=placed.pool, instances=placed.instances, parallel=placed.parallel)
        stages.append(stage)
    return StageGraph(graph.pipeline, pools, graph.models.values(), graph.data.values(), graph.schedule,
                      stages, graph.flows())


def _used(graph: StageGraph, layout: Layout, pool: str) -> bool:
    """Whether a pool the layout does not size still hosts a stage it does not move."""
    return any(s.pool == pool and layout.stage(s.name) is None for s in graph.stages())
