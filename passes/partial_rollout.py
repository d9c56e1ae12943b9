"""partial-rollout{max_split}: at a weight sync, long in-flight generations pause and resume
under the new weights instead of holding the sync back (beyond the ASP paper).

Removes: skewness bubble (the long tail of one step delays the next weight sync).
Assumes: async-decouple ran with staleness >= 1, so a sample whose tokens span policy versions
v..v+j stays usable while the train step's u - v <= k; a sample is cut at most `max_split` times.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from aspc.ir.graph import PartialRollout as Split, StageGraph, StageKind
from aspc.passes.base import Pass, PassError


@dataclass(frozen=True)
class PartialRollout(Pass):
    name = "partial-rollout"
    after = {"async-decouple": "a split sample stays usable only within the staleness bound it sets"}
    bubble = "skewness"
    max_split: int = 2

    def apply(self, graph: StageGraph) -> StageGraph:
        if self.max_split < 1:
            raise PassError(f"max_split must be >= 1, got {self.max_split}")
        syncs = graph.stages_of(StageKind.WEIGHT_SYNC)
        if not graph.stages_of(StageKind.CHANNEL) or not syncs:
            raise PassError("needs async-decouple first (a bounded channel and weight syncs)")
        staleness = min(s.weight_sync.staleness for s in syncs)
        if staleness < 1:
            raise PassError("needs staleness >= 1: with staleness 0 every token of a sample must "
                            "come from one policy version")
        stages = []
        for s in graph.stages():
            if s.kind is StageKind.GENERATE:
                s = s.with_results(partial_rollout=Split(self.max_split))
            elif s.kind is StageKind.WEIGHT_SYNC:
                s = s.with_results(weight_sync=replace(s.weight_sync, interrupt=True))
            stages.append(s)
        return graph.rebuilt(stages, graph.flows())
