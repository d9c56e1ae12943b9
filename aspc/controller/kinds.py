"""The controller's reading of the stage-kind table (aspc/ir/kinds.py): the rule of a plan's stage,
and the stages no driver executes yet.

The controller builds its queues from the table, the drivers look up the role that executes a
stage there, and the simulator looks up how a stage is priced. A plan shape no driver runs is
turned away before a run with a message at its source line — never run for free.
"""
from __future__ import annotations

from aspc.controller.rebalance import refusal as rebalance_refusal
from aspc.ir.kinds import KindRule, kind_rule
from aspc.plan.execution_plan import ExecutionPlan, StagePlan, StageRefusal

__all__ = ["JUDGE_VERDICT_TOKENS", "KindRule", "refusals", "rule_for"]

# What a judge decodes per sample: the one verdict token every judge the runtime executes reads
# (P("1") or the greedy token at the first generated position: backends/cpu/judge.py); the NPU
# judge's engine is lowered with it as max_tokens, so nothing decodes a reason nobody reads.
JUDGE_VERDICT_TOKENS = 1


def rule_for(stage: StagePlan) -> KindRule:
    """The rule of a plan stage: its kind's, a reward stage's by its sources (a judge, a model)."""
    sources = dict(stage.options).get("sources", ()) if stage.kind == "reward" else ()
    return kind_rule(stage.kind, (source.func for source in sources))


def refusals(plan: ExecutionPlan) -> list[StageRefusal]:
    """Stages no driver executes yet, each said at its stage (the CLI adds the source line)."""
    found = []
    for kind in ("generate", "train"):
        stages = plan.stages_of(kind)
        for stage in stages[1:]:
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the runtime runs one {kind} stage per "
                                                  f"pipeline, and '{stages[0].name}' is one",
                                      "split the pipeline in two, one per generate and train stage"))
    return found + [r for r in [rebalance_refusal(plan)] if r is not None]
