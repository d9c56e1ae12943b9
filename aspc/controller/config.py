"""What the controller needs to know, read from an execution plan."""
from __future__ import annotations

from dataclasses import dataclass

from aspc.plan.execution_plan import ExecutionPlan

FORWARD_KINDS = ("reward", "reference", "critic")


class UnsupportedPlan(Exception):
    """The runtime cannot execute this plan shape (said with what to change)."""


@dataclass(frozen=True)
class ControllerConfig:
    steps: int
    prompts_per_step: int
    group: int
    instances: int
    staleness: int
    policy: str
    group_affinity: bool
    stream_micro: int | None  # samples per streamed unit; None: a barrier on the whole step
    partial_rollout: int  # max splits of one sample at weight syncs; 0: drain before a sync
    forward_stages: tuple[tuple[str, str], ...]  # (stage, kind) run on each unit before training
    train_stage: str
    max_response: int
    checkpoint_every: int = 0

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group

    @staticmethod
    def from_plan(plan: ExecutionPlan, steps: int, checkpoint_every: int = 0) -> ControllerConfig:
        generators, trainers = plan.stages_of("generate"), plan.stages_of("train")
        if len(generators) != 1 or len(trainers) != 1:
            raise UnsupportedPlan("the runtime executes one generate and one train stage; this plan has "
                                  f"{len(generators)} and {len(trainers)}")
        gen, train = generators[0], trainers[0]
        data = plan.dataset(gen.data)
        dispatch = next((d for d in plan.dispatches if d.target == gen.name), None)
        forward = tuple((s.name, s.kind) for s in plan.stages if s.kind in FORWARD_KINDS)
        return ControllerConfig(
            steps=steps, prompts_per_step=data.prompts_per_step, group=data.group,
            instances=len(gen.instances), staleness=plan.staleness,
            policy=dispatch.policy if dispatch else "round_robin",
            group_affinity=dispatch.group_affinity if dispatch else True,
            stream_micro=train.stream_micro, partial_rollout=gen.partial_rollout,
            forward_stages=forward, train_stage=train.name, max_response=data.max_response,
            checkpoint_every=checkpoint_every)
