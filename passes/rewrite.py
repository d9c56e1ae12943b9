"""Small graph-rewriting helpers shared by the passes (pure: lists in, lists out)."""
from __future__ import annotations

from dataclasses import replace

from aspc.ir.graph import WEIGHTS, Flow, Stage, StageGraph, StageKind, WeightSyncSpec


def interpose(flows: list[Flow], src: str, dsts: list[str], node: str) -> list[Flow]:
    """Route the flows src -> each of dsts through `node`: src -> node -> dst, same fields."""
    moved = [f for f in flows if f.src == src and f.dst in dsts]
    if not moved:
        return flows
    fields = tuple(sorted({x for f in moved for x in f.fields}))
    kept = [f for f in flows if f not in moved]
    return merge_flows(kept + [Flow(src, node, fields)] + [Flow(node, f.dst, f.fields) for f in moved])


def merge_flows(flows: list[Flow]) -> list[Flow]:
    """One flow per (src, dst): fields of parallel flows are united."""
    merged: dict[tuple[str, str], set[str]] = {}
    for f in flows:
        merged.setdefault((f.src, f.dst), set()).update(f.fields)
    return [Flow(src, dst, tuple(sorted(fields))) for (src, dst), fields in merged.items()]


def responses_producers(graph: StageGraph) -> list[Stage]:
    """Stages whose responses the rest of the pipeline consumes (generate, or environment)."""
    producers = []
    for stage in graph.stages():
        if stage.kind not in (StageKind.GENERATE, StageKind.ENVIRONMENT):
            continue
        consumers = graph.consumers(stage.name)
        if any(c.kind is not StageKind.ENVIRONMENT for c in consumers):
            producers.append(stage)
    return producers


def weight_sync_name(generator: str) -> str:
    return f"{generator}.weights"


def ensure_weight_syncs(graph: StageGraph, stages: list[Stage], flows: list[Flow]):
    """Every GENERATE stage gets a WEIGHT_SYNC node fed by the TRAIN stage of its model."""
    names = {s.name for s in stages}
    for train in graph.stages_of(StageKind.TRAIN):
        for gen in graph.stages_of(StageKind.GENERATE):
            node = weight_sync_name(gen.name)
            if gen.model != train.model or node in names:
                continue
            stages.append(Stage(node, StageKind.WEIGHT_SYNC, model=train.model,
                                weight_sync=WeightSyncSpec("sync", 0)))
            flows += [Flow(train.name, node, (WEIGHTS,)), Flow(node, gen.name, (WEIGHTS,))]
            names.add(node)
    return stages, flows


def replace_stage(stages: list[Stage], name: str, **changes) -> list[Stage]:
    return [replace(s, **changes) if s.name == name else s for s in stages]
