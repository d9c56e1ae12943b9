"""stream{micro}: downstream stages consume micro-batches of `micro` samples as they arrive.

Removes: sorting bubble (a stage waiting for the whole step to be generated, gathered and sorted).
Assumes: group-relative advantages (grpo, dapo, rloo) see whole groups, so `micro` is a multiple
of the group size. Training accumulates gradients per micro-batch and steps once per step.
Without it every consumer waits at a barrier for the whole step. A consumer that time-shares its
devices with generation (placed after `place`) keeps the barrier: it cannot run while generation
holds the devices, and streaming would only cut its micro-batches smaller.
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.graph import StageGraph, StageKind, Streaming
from aspc.ir.kinds import kinds_where
from aspc.passes.base import Pass, PassError

CONSUMERS = kinds_where(lambda rule: rule.streamed)
GROUP_ESTIMATORS = ("grpo", "dapo", "rloo")


@dataclass(frozen=True)
class Stream(Pass):
    name = "stream"
    bubble = "sorting"
    after = {"place": "it keeps the barrier of stages that time-share devices with generation, "
                      "which only `place` decides"}
    micro: int = 16

    def apply(self, graph: StageGraph) -> StageGraph:
        if self.micro < 1:
            raise PassError(f"micro must be >= 1, got {self.micro}")
        self._check_groups(graph)
        colocated = _colocated_with_generation(graph)
        stages = [s.with_results(streaming=Streaming(self.micro)) if s.kind in CONSUMERS and s.name not in colocated
                  else s for s in graph.stages()]
        return graph.rebuilt(stages, graph.flows())

    def _check_groups(self, graph: StageGraph) -> None:
        if not any(a.option("estimator") in GROUP_ESTIMATORS for a in graph.stages_of(StageKind.ADVANTAGE)):
            return
        for data in graph.data.values():
            if self.micro % data.group:
                raise PassError(f"micro={self.micro} splits the groups of {data.group} responses of "
                                f"data '{data.name}'; group-relative advantages need whole groups: "
                                f"use a multiple of {data.group}")


def _colocated_with_generation(graph: StageGraph) -> set[str]:
    """Stages placed time-shared on a pool where generation runs too."""
    gen_pools = {g.pool for g in graph.stages_of(StageKind.GENERATE)}
    return {s.name for s in graph.stages()
            if s.pool in gen_pools and s.placement is not None and s.placement.kind == "time_shared"}
