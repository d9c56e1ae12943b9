"""Source to plan in one call: front end, the schedule's passes, the execution plan.

The CLI, the benchmarks and the tests use it; it wires the layers together and adds nothing.
It lives with the CLI, the one place that wires layers (DESIGN.md), above the passes: in
aspc/plan/ it made a cycle (plan -> passes -> cost model -> plan); a contract in pyproject.toml
now keeps the execution plan free of the front end, the passes and the cost model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from aspc.frontend.compiler import Compilation, compile_file
from aspc.frontend.diagnostics import AsplError, Diagnostic
from aspc.passes.manager import PassRun, run_passes
from aspc.passes.schedules import pipeline_for, schedule_for
from aspc.passes.spec import PassSpec, parse_pipeline, pipeline_text
from aspc.plan.execution_plan import ExecutionPlan, PlanError, build_plan
from aspc.ir.span import Span

SCHEDULE_SOURCE = "<schedule>"


@dataclass
class Compiled:
    compilation: Compilation
    run: PassRun
    passes: str

    @property
    def graph(self):
        return self.run.graph

    def plan(self) -> ExecutionPlan:
        try:
            return build_plan(self.run.graph, self.passes)
        except PlanError as error:
            raise AsplError([Diagnostic("error", Span.point("<-p>"), str(error), error.hint)]) from None


def compile_with_passes(path: str | Path, overrides: list[str] | None = None, schedule: str | None = None,
                        pipeline: str | None = None, emit_after: str | None = None,
                        verify_each: bool = True) -> Compiled:
    """Compile a file and run a pass pipeline: `pipeline` if given, else the schedule's."""
    return run_schedule(compile_file(path, overrides), schedule, pipeline, emit_after, verify_each)


def run_schedule(compilation: Compilation, schedule: str | None = None, pipeline: str | None = None,
                 emit_after: str | None = None, verify_each: bool = True) -> Compiled:
    """Run the passes of `pipeline` (or of the schedule) on a compiled program."""
    chosen = schedule_for(compilation.graph, schedule)
    graph = compilation.graph.with_schedule(chosen)
    if pipeline is None:
        return _run_schedule_passes(compilation, graph, verify_each, emit_after)
    compilation.sources["<-p>"] = pipeline
    specs = parse_pipeline(pipeline)
    run = run_passes(graph, specs, verify_each, emit_after)
    return Compiled(compilation, run, pipeline_text([s.instance for s in specs]))


def _run_schedule_passes(compilation: Compilation, graph, verify_each: bool, emit_after: str | None) -> Compiled:
    """The schedule's pipeline. `auto-place` runs first and may choose schedule settings (staleness,
    pack, buckets): the passes after it are those of the schedule it returns."""
    specs = _schedule_specs(pipeline_for(graph.schedule), graph.schedule.span, compilation)
    later = [s.instance.name for s in specs[1:]]
    if specs[0].instance.name == "auto-place" and (emit_after is None or emit_after in later):
        placed = run_passes(graph, specs[:1], verify_each)
        specs = specs[:1] + _schedule_specs(pipeline_for(placed.graph.schedule), graph.schedule.span, compilation)[1:]
        rest = run_passes(placed.graph, specs[1:], verify_each, emit_after)
        run = PassRun(rest.graph, placed.steps + rest.steps)
    else:
        run = run_passes(graph, specs, verify_each, emit_after)
    return Compiled(compilation, run, pipeline_text([s.instance for s in specs]))


def _schedule_specs(text: str, span: Span | None, compilation: Compilation) -> list[PassSpec]:
    """A schedule's pipeline: its passes point at the schedule declaration of the file."""
    compilation.sources[SCHEDULE_SOURCE] = text
    specs = parse_pipeline(text, SCHEDULE_SOURCE)
    where = span or Span.point(str(compilation.program.file))
    return [replace(s, span=where) for s in specs]


__all__ = ["Compiled", "compile_with_passes", "AsplError", "Diagnostic"]
