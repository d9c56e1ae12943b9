"""place: maps stages onto their pools' devices and records weight-sync resharding.

Removes: nothing by itself; it decides disaggregated vs colocated execution, which the sync
bubble depends on.
Assumes: every stage fits its pool (the checker guarantees it).
On each pool, stages that fit side by side get disjoint device ranges (disaggregated); if they
do not, they time-share the pool from device 0 (colocated: offload/onload between them).
Every GENERATE stage gets a WEIGHT_SYNC from the TRAIN stage of its model, annotated with the
bytes to move, the train and generate layouts (e.g. tp=8 pp=2 -> tp=4) and how they move.
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.facts import DTYPE_BYTES
from aspc.ir.graph import Placement, Stage, StageGraph, StageKind, WeightTransfer
from aspc.passes.base import Pass
from aspc.passes.rewrite import ensure_weight_syncs


@dataclass(frozen=True)
class Place(Pass):
    name = "place"

    def apply(self, graph: StageGraph) -> StageGraph:
        stages, flows = ensure_weight_syncs(graph, graph.stages(), graph.flows())
        placed = {s.name: s for s in stages}
        for pool in graph.pools:
            for stage in _place_pool(graph, [s for s in stages if s.pool == pool]):
                placed[stage.name] = stage
        stages = [placed[s.name] for s in stages]
        by_name = {s.name: s for s in stages}
        stages = [_annotate_sync(graph, s, by_name, flows) if s.kind is StageKind.WEIGHT_SYNC else s
                  for s in stages]
        return graph.rebuilt(stages, flows)


def _place_pool(graph: StageGraph, stages: list[Stage]) -> list[Stage]:
    if not stages:
        return []
    count = graph.pools[stages[0].pool].count
    if sum(s.devices for s in stages) <= count:
        offsets, offset = [], 0
        for s in stages:
            offsets.append(offset)
            offset += s.devices
        return [s.with_results(placement=Placement("dedicated", o)) for s, o in zip(stages, offsets)]
    return [s.with_results(placement=Placement("time_shared", 0)) for s in stages]


def _annotate_sync(graph: StageGraph, sync: Stage, stages: dict[str, Stage], flows) -> Stage:
    train = stages[next(f.src for f in flows if f.dst == sync.name)]
    gen = stages[next(f.dst for f in flows if f.src == sync.name)]
    model = graph.models[train.model]
    nbytes = model.arch.total_params() * DTYPE_BYTES[model.dtype]
    return sync.with_results(weight_transfer=WeightTransfer(
        nbytes, _layout(train), _layout(gen), _layout(train) != _layout(gen), _transfer(train, gen)))


def _layout(stage: Stage) -> str:
    p = stage.parallel
    return f"tp={p.tp} pp={p.pp} ep={p.ep}"


def _transfer(train: Stage, gen: Stage) -> str:
    """offload_onload when they share devices (colocated), else a copy over the interconnect."""
    if train.pool != gen.pool:
        return "link"
    a = range(train.placement.device_offset, train.placement.device_offset + train.devices)
    b = range(gen.placement.device_offset, gen.placement.device_offset + gen.devices)
    return "offload_onload" if set(a) & set(b) else "link"
