"""What the simulator cannot price yet, said before it runs: a stage it would otherwise count as
free. Nothing the language accepts is silently ignored (the reward-model, judge and agentic
issues, 12 and 13, will price these)."""
from __future__ import annotations

from dataclasses import dataclass

from aspc.plan import ExecutionPlan

UNPRICED_SOURCES = {
    "model": "a reward model's scoring pass",
    "judge": "an LLM judge's generation",
}


@dataclass(frozen=True)
class Unpriced:
    stage: str
    what: str
    hint: str


def unpriced_stages(plan: ExecutionPlan) -> list[Unpriced]:
    found = []
    for stage in plan.stages:
        if stage.kind == "environment":
            found.append(Unpriced(stage.name, "environment stages (multi-turn episodes, tool calls)",
                                  "simulate the pipeline without the environment stage until agentic RL is priced"))
        for source in dict(stage.options).get("sources", ()) if stage.kind == "reward" else ():
            if source.func in UNPRICED_SOURCES:
                what = f"{source.func}(...) reward sources ({UNPRICED_SOURCES[source.func]})"
                found.append(Unpriced(stage.name, what,
                                      "use rule(...) or python(...) sources to simulate the rest of the pipeline"))
    return found
