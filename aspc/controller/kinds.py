"""The stage-kind rule table: for each kind of stage, what it consumes and produces, whether it
needs a model and devices, how the controller moves its work and which executor role runs it.

The controller builds its queues from this table, the drivers look up the role that executes a
stage here, and the simulator looks up how a stage is priced. A stage whose rule says `refused`
is turned away before a run with a message at its source line — never run for free.
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.controller.rebalance import refusal as rebalance_refusal
from aspc.plan.execution_plan import ExecutionPlan, StagePlan, StageRefusal


@dataclass(frozen=True)
class KindRule:
    kind: str
    consumes: str  # "prompts" | "samples" (whole groups of finished samples, per streamed unit)
    produces: str
    role: str | None  # "generation" | "forward_model" | "judge" | "trainer" | "tool_runner"; None: host
    dispatched: bool  # requests are routed to the stage's instances by a dispatch policy
    streamed: bool  # runs once per streamed unit of whole groups (else: per request)
    packed: bool  # its units are packed into micro-batches (the pack pass's shapes)
    priced_as: str  # the simulator: "decode" | "forward" | "judge" | "train" | "episode" (turns and tool
    # waits inside the generation instances) | "host" (no device time)
    refused: str = ""  # why no driver executes or prices it yet ("" when it runs)


RULES: dict[str, KindRule] = {r.kind: r for r in (
    KindRule("generate", "prompts", "responses", "generation", True, False, False, "decode"),
    # Episodes run inside the generation instance that holds their KV (sticky): a model turn, a
    # tool call on the tool runners, the observation appended, the next turn (aspc/controller/episodes.py).
    KindRule("environment", "responses", "responses", "tool_runner", True, False, False, "episode"),
    KindRule("reward", "samples", "rewards", None, False, True, False, "host"),
    KindRule("reference", "samples", "ref_logprobs", "trainer", False, True, True, "forward"),
    KindRule("critic", "samples", "values", "trainer", False, True, True, "forward"),
    KindRule("advantage", "samples", "advantages", None, False, False, False, "host"),
    KindRule("train", "samples", "weights", "trainer", False, True, True, "train"),
)}

# A reward stage's rule depends on its sources: a model() source scores on the stage's pool.
_REWARD_MODEL = KindRule("reward", "samples", "rewards", "forward_model", False, True, False, "forward")
# A judge(...) source generates a verdict per sample on the stage's pool: a prefill of rubric,
# prompt and response and a one-token decode (backends/sim/pricing.py, RooflinePricing.judge). Its
# units go to a free executor of the stage like a reward model's (no dispatch policy routes them).
_JUDGE = KindRule("reward", "samples", "rewards", "judge", False, True, False, "judge")
# What a judge decodes per sample: the one verdict token every judge the runtime executes reads
# (P("1") or the greedy token at the first generated position: backends/cpu/judge.py); the NPU
# judge's engine is lowered with it as max_tokens, so nothing decodes a reason nobody reads.
JUDGE_VERDICT_TOKENS = 1


def rule_for(stage: StagePlan) -> KindRule | None:
    """The rule of a stage kind that runs (None for what passes insert: channels, dispatch, syncs)."""
    if stage.kind == "reward":
        funcs = {source.func for source in dict(stage.options).get("sources", ())}
        if "judge" in funcs:
            return _JUDGE
        if "model" in funcs:
            return _REWARD_MODEL
    return RULES.get(stage.kind)


def refusals(plan: ExecutionPlan) -> list[StageRefusal]:
    """Stages no driver executes yet, each said at its stage (the CLI adds the source line)."""
    found = []
    for stage in plan.stages:
        rule = rule_for(stage)
        if rule is not None and rule.refused:
            hint = "leave the environment stage out until agentic RL lands" if stage.kind == "environment" else ""
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': no driver executes or prices "
                                                  f"{rule.refused} yet, and they are never counted as free", hint))
    for kind in ("generate", "train"):
        first, *more = plan.stages_of(kind) or [None]
        for stage in more:
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the runtime runs one {kind} stage per "
                                                  f"pipeline, and '{first.name}' is one",
                                      "split the pipeline in two, one per generate and train stage"))
    return found + [r for r in [rebalance_refusal(plan)] if r is not None]
