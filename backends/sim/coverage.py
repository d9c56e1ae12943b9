"""What the simulator cannot price yet, said before it runs: a stage it would otherwise count as
free. Nothing the language accepts is silently ignored (the reward-model, judge and agentic
issues, 12 and 13, will price these)."""
from __future__ import annotations

from aspc.plan.execution_plan import ExecutionPlan, StageRefusal

UNPRICED_SOURCES = {
    "model": "a reward model's scoring pass",
    "judge": "an LLM judge's generation",
}


def unpriced_stages(plan: ExecutionPlan) -> list[StageRefusal]:
    found = []
    for stage in plan.stages:
        if stage.kind == "environment":
            found.append(_refusal(stage.name, "environment stages (multi-turn episodes, tool calls)",
                                  "simulate the pipeline without the environment stage until agentic RL is priced"))
        for source in dict(stage.options).get("sources", ()) if stage.kind == "reward" else ():
            if source.func in UNPRICED_SOURCES:
                found.append(_refusal(stage.name, f"{source.func}(...) reward sources "
                                                  f"({UNPRICED_SOURCES[source.func]})",
                                      "use rule(...) or python(...) sources to simulate the rest of the pipeline"))
    return found


def _refusal(stage: str, what: str, hint: str) -> StageRefusal:
    return StageRefusal(stage, f"stage '{stage}': the simulator cannot price {what} yet and would count "
                               "them as free", hint)
