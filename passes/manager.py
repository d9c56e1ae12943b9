"""The pass manager: runs a pipeline, verifies after each pass, stops where asked, and names the
failing pass with the passes that ran before it."""
from __future__ import annotations

from dataclasses import dataclass, field

from aspc.frontend.diagnostics import AsplError, Diagnostic
from aspc.ir.graph import StageGraph
from aspc.passes.base import PassError
from aspc.passes.spec import PassSpec
from aspc.ir.verify import VerificationError, verify


@dataclass(frozen=True)
class PassStep:
    spec: PassSpec
    before: StageGraph
    after: StageGraph


@dataclass
class PassRun:
    graph: StageGraph
    steps: list[PassStep] = field(default_factory=list)


def run_passes(graph: StageGraph, specs: list[PassSpec], verify_each: bool = True,
               emit_after: str | None = None) -> PassRun:
    """Apply the passes in order. Raises AsplError naming the pass that failed."""
    if emit_after is not None and emit_after not in [s.instance.name for s in specs]:
        names = ", ".join(s.instance.name for s in specs) or "none"
        raise AsplError([Diagnostic("error", specs[0].span if specs else _nowhere(),
                                    f"--emit-after {emit_after}: no such pass in the pipeline",
                                    f"passes in this pipeline: {names}")])
    _check_order(specs)
    run = PassRun(graph)
    for spec in specs:
        after = _apply(spec, run.graph, [s.spec.instance.spec() for s in run.steps], verify_each)
        run.steps.append(PassStep(spec, run.graph, after))
        run.graph = after
        if spec.instance.name == emit_after:
            break
    return run


def _check_order(specs: list[PassSpec]) -> None:
    """Every declared ordering constraint (`Pass.after`) holds, or one error per broken one."""
    position = {s.instance.name: i for i, s in enumerate(specs)}
    errors = [Diagnostic("error", spec.span, f"pass '{spec.instance.name}' must run after '{name}': {why}",
                         f"move '{spec.instance.name}' after '{name}' in the pipeline")
              for i, spec in enumerate(specs) for name, why in spec.instance.after.items()
              if position.get(name, -1) > i]
    if errors:
        raise AsplError(errors)


def _apply(spec: PassSpec, graph: StageGraph, before: list[str], verify_each: bool) -> StageGraph:
    ran = "passes before it: " + (", ".join(before) if before else "none")
    try:
        result = spec.instance.apply(graph)
        if verify_each:
            verify(result)
    except PassError as error:
        raise AsplError([Diagnostic("error", spec.span, f"pass '{spec.instance.name}' failed: {error}",
                                    ran)]) from None
    except VerificationError as error:
        raise AsplError([Diagnostic("error", spec.span, f"pass '{spec.instance.name}' broke an IR "
                                                        f"invariant (a compiler bug): {error}", ran)]) from None
    return result


def _nowhere():
    from aspc.ir.span import Span

    return Span.point("<-p>")
