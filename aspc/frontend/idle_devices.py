"""A warning for devices of a pool that no stage ever uses.

Stages on one pool that fit side by side get disjoint device ranges; if they do not fit, they
time-share it from device 0 (the place pass). Either way the devices past the last range (side
by side) or past the largest stage (time-shared) are paid for and never run anything.
"""
from __future__ import annotations

from aspc.frontend.diagnostics import DiagnosticSink
from aspc.ir.graph import PoolSpec, Stage, StageGraph, StageKind

_GROWS_BY_DP = (StageKind.TRAIN, StageKind.CRITIC)  # one job each: more data parallelism, not instances
MOST_NAMED = 8  # stage names a warning lists before "and N more"


def warn_idle_devices(graph: StageGraph, sink: DiagnosticSink) -> None:
    on_pool = _stages_by_pool(graph)
    for pool in graph.pools.values():
        stages = on_pool.get(pool.name, [])
        if not stages:
            sink.warning(pool.span, f"no stage runs on pool '{pool.name}': its {pool.count} devices stay idle",
                         f"place a stage on it with `on {pool.name}`, or remove it")
        elif sum(s.devices for s in stages) <= pool.count:
            _side_by_side(pool, stages, sink)
        else:
            _time_shared(pool, stages, sink)


def _stages_by_pool(graph: StageGraph) -> dict[str, list[Stage]]:
    """Each pool's stages in stage order, in one pass (a pass per pool was quadratic: issue 37)."""
    on_pool: dict[str, list[Stage]] = {}
    for stage in graph.stages():
        on_pool.setdefault(stage.pool, []).append(stage)
    return on_pool


def _side_by_side(pool: PoolSpec, stages: list[Stage], sink: DiagnosticSink) -> None:
    used = sum(s.devices for s in stages)
    if used == pool.count:
        return
    idle = pool.count - used
    if len(stages) == 1:
        stage = stages[0]
        sink.warning(stage.span, f"stage '{stage.name}' uses {used} of the {pool.count} devices of pool "
                                 f"'{pool.name}' ({_layout(stage)}); the other {idle} stay idle",
                     _grow_hint(stage, pool))
        return
    names = _named(stages)
    sizes = " + ".join(str(s.devices) for s in stages) + " = " if len(stages) <= MOST_NAMED else ""
    sink.warning(pool.span, f"stages {names} side by side use {sizes}{used} of the {pool.count} devices of "
                            f"pool '{pool.name}'; the other {idle} stay idle",
                 f"give them more instances or parallelism, or make the pool {used} devices")


def _time_shared(pool: PoolSpec, stages: list[Stage], sink: DiagnosticSink) -> None:
    largest = max(stages, key=lambda s: s.devices)
    if largest.devices == pool.count:
        return
    others = _named([s for s in stages if s is not largest])
    sink.warning(largest.span, f"stage '{largest.name}' time-shares pool '{pool.name}' with {others} and "
                               f"uses {largest.devices} of its {pool.count} devices ({_layout(largest)}), the "
                               f"most of them; the other {pool.count - largest.devices} stay idle",
                 _grow_hint(largest, pool))


def _named(stages: list[Stage]) -> str:
    """The stages' names, the first MOST_NAMED of a long list (a warning stays one readable line)."""
    names = ", ".join(f"'{s.name}'" for s in stages[:MOST_NAMED])
    return names if len(stages) <= MOST_NAMED else f"{names} and {len(stages) - MOST_NAMED} more"


def _layout(stage: Stage) -> str:
    p = stage.parallel
    return f"instances {stage.instances} x tp {p.tp} x pp {p.pp} x dp {p.dp} x cp {p.cp}"


def _grow_hint(stage: Stage, pool: PoolSpec) -> str:
    shrink = f"or make the pool {stage.devices} devices"
    if pool.count % stage.devices:
        return f"raise instances or a parallel degree to use them, {shrink}"
    factor = pool.count // stage.devices
    if stage.kind in _GROWS_BY_DP:
        return f"use them, e.g. dp = {stage.parallel.dp * factor}, {shrink}"
    return f"use them, e.g. instances = {stage.instances * factor}, {shrink}"
