"""continuous-batching: finished sequences leave an instance's batch and waiting ones join at once.

Removes: padding bubble (decode slots held by finished sequences in a static batch).
Assumes: GENERATE stages exist. Without it, generation runs static batches to the longest member.
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.graph import Batching, StageGraph, StageKind
from aspc.passes.base import Pass


@dataclass(frozen=True)
class ContinuousBatching(Pass):
    name = "continuous-batching"
    bubble = "padding"

    def apply(self, graph: StageGraph) -> StageGraph:
        stages = [s.with_results(batching=Batching("continuous")) if s.kind is StageKind.GENERATE else s
                  for s in graph.stages()]
        return graph.rebuilt(stages, graph.flows())
