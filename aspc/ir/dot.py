"""Graphviz DOT for a stage graph: a cluster per pool, edges labelled with their fields."""
from __future__ import annotations

from aspc.ir.graph import Stage, StageGraph

_COLORS = {"GENERATE": "#cfe8ff", "ENVIRONMENT": "#e0d4ff", "REWARD": "#fff2b3", "REFERENCE": "#e5e5e5",
           "CRITIC": "#ffd9b3", "ADVANTAGE": "#fce0ec", "TRAIN": "#c9f2c9", "CHANNEL": "#ffffff",
           "DISPATCH": "#ffffff", "WEIGHT_SYNC": "#ffffff"}


def to_dot(graph: StageGraph) -> str:
    lines = [f'digraph "{graph.pipeline}" {{', "  rankdir=LR;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
             '  edge [fontname="Helvetica", fontsize=10];']
    by_pool: dict[str | None, list[Stage]] = {}
    for stage in graph.stages():
        by_pool.setdefault(stage.pool, []).append(stage)
    for pool, stages in sorted(by_pool.items(), key=lambda kv: kv[0] or ""):
        lines += _cluster(graph, pool, stages)
    for flow in graph.flows():
        style = ", style=dashed, constraint=false" if flow.fields == ("weights",) else ""
        lines.append(f'  "{flow.src}" -> "{flow.dst}" [label="{", ".join(flow.fields)}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster(graph: StageGraph, pool: str | None, stages: list[Stage]) -> list[str]:
    nodes = [f"    {_node(s)}" for s in stages]
    if pool is None:
        return [n[2:] for n in nodes]
    spec = graph.pools[pool]
    return [f'  subgraph "cluster_{pool}" {{', f'    label="{pool}: {spec.hardware.name} x {spec.count}";',
            '    style=dashed;', *nodes, "  }"]


_SHAPES = {"CHANNEL": "cds", "DISPATCH": "diamond", "WEIGHT_SYNC": "note"}


def _detail(stage: Stage) -> str:
    """One line for a pass-inserted node: what the schedule decided there."""
    if stage.channel is not None:
        return f"\\ncap {stage.channel.capacity}, staleness {stage.channel.staleness}"
    if stage.dispatch is not None:
        return f"\\n{stage.dispatch.policy}"
    moved = stage.weight_transfer
    if stage.weight_sync is not None and moved is not None and moved.bytes:
        return f"\\n{moved.bytes / 1e9:.1f} GB {stage.weight_sync.mode}, {moved.transfer}"
    return ""


def _node(stage: Stage) -> str:
    label = f"{stage.name}\\n{stage.kind.name}"
    if stage.model:
        label += f"({stage.model})"
    label += _detail(stage)
    if stage.pool is not None:
        label += f"\\nx{stage.instances} tp{stage.parallel.tp}"
        if stage.parallel.pp > 1:
            label += f" pp{stage.parallel.pp}"
        if stage.parallel.ep > 1:
            label += f" ep{stage.parallel.ep}"
    shape = f", shape={_SHAPES[stage.kind.name]}" if stage.kind.name in _SHAPES else ""
    return f'"{stage.name}" [label="{label}", fillcolor="{_COLORS[stage.kind.name]}"{shape}];'
