"""queue-aware-dispatch{policy}: a DISPATCH node in front of every multi-instance stage whose
kind the controller routes by a dispatch policy (the kind table's `dispatched`: generation).

Removes: skewness bubble (an instance idle while another still has a queue).
Assumes: nothing; stages with one instance need no dispatch. Reward models, judges, reference and
critic stages get none: the controller hands their units to a free executor of the stage.
Policies, carried out by the controller:
  queue_aware     send to the instance with the least queued *work* (predicted tokens in flight
                  and waiting, from prompt length and the group's length history), keep a
                  prompt's group on one instance when prefix reuse pays, never leave an instance
                  idle while another has waiting work;
  least_requests  the fewest requests in flight (what most serving routers do);
  round_robin     an even split in arrival order (the synchronous baseline).
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.graph import PROMPTS, DispatchSpec, Flow, Stage, StageGraph, StageKind
from aspc.ir.kinds import KIND_RULES
from aspc.passes.base import Pass, PassError
from aspc.passes.rewrite import interpose

POLICIES = ("queue_aware", "least_requests", "round_robin")


@dataclass(frozen=True)
class QueueAwareDispatch(Pass):
    name = "queue-aware-dispatch"
    bubble = "skewness"
    policy: str = "queue_aware"
    group_affinity: bool = True

    def apply(self, graph: StageGraph) -> StageGraph:
        if self.policy not in POLICIES:
            raise PassError(f"unknown policy '{self.policy}'; choose one of {', '.join(POLICIES)}")
        if graph.stages_of(StageKind.DISPATCH):
            raise PassError("the graph already has DISPATCH nodes")
        stages, flows = graph.stages(), graph.flows()
        for stage in graph.stages():
            if not KIND_RULES[stage.kind].dispatched or stage.instances < 2:
                continue
            node = f"{stage.name}.dispatch"
            stages.append(Stage(node, StageKind.DISPATCH, dispatch=DispatchSpec(
                stage.name, self.policy, self.group_affinity, stage.instances)))
            if KIND_RULES[stage.kind].consumes == PROMPTS:
                flows.append(Flow(node, stage.name, (PROMPTS,)))
            else:
                for src in graph.producers(stage.name):
                    flows = interpose(flows, src.name, [stage.name], node)
        return graph.rebuilt(stages, flows)
