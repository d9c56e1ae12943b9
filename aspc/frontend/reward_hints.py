"""The hint of "an advantage gets rewards from two stages": one reward stage with both `sources`."""
from __future__ import annotations

from aspc.ir.graph import Stage, StageGraph, StageKind
from aspc.ir.values import Call, format_value

_FIRST = {"rule": "name", "python": "function", "model": "model", "judge": "model"}  # written positionally


def combine_rewards_hint(graph: StageGraph, first: str, second: str, consumer: str) -> str:
    """`stage score = reward(gen, sources = [<first's>, <second's>])`, passed alone to `consumer`."""
    stages = sorted([graph.stage(first), graph.stage(second)], key=_written_at)
    if any(s.kind is not StageKind.REWARD for s in stages):
        return ""
    keep = stages[0]
    sources = ", ".join(source_text(c) for s in stages for c in s.option("sources", ()))
    inputs = ", ".join(p.name for p in graph.producers(keep.name))
    pool = next((f" on {s.pool}" for s in stages if s.pool), "")
    return (f"combine them in one reward stage, a weighted sum of their sources: "
            f"`stage {keep.name} = reward({inputs}, sources = [{sources}]){pool}`, "
            f"and pass only '{keep.name}' to '{consumer}' (docs/language.md, \"Rewards\")")


def _written_at(stage: Stage) -> tuple[int, int]:
    return (stage.span.line, stage.span.column) if stage.span else (0, 0)


def source_text(call: Call) -> str:
    """A source as .aspl text: its main argument and its weight (a judge's rubric shortened to "...")."""
    main = call.get(_FIRST.get(call.func, ""))
    args = [] if main is None else [main if call.func in ("model", "judge") else format_value(main)]
    if call.func == "judge" and call.get("prompt"):
        args.append('prompt = "..."')
    args.append(f"weight = {format_value(call.get('weight', 1.0))}")
    return f"{call.func}({', '.join(args)})"
