"""auto-place: the compiler chooses the layout (`schedule asp { placement = auto }`).

Removes: the bubbles a layout causes — one side idle waiting for the other (generation- or
learner-bound splits), instances below their saturated batch (tail), weight-sync and pool-switch
time — by searching the layouts of aspc/ir/layout_space.py and the schedule settings of
passes/knob_space.py with the closed-form objective of passes/layout_estimate.py (ranked in
passes/layout_search.py), and rewriting
pools, stages and the schedule's searched settings to the best.
Assumes: one generate and one train stage; runs before `place` (which then places the chosen
layout). Every parallel degree the program writes is a constraint; the split, the generate
instances and the learner-side dp are the pass's to choose. It records its choice, the predicted
throughput, the written layout's prediction and the runners-up as a LayoutChoice on the generate
stage (`aspc inspect` shows it; `aspc tune` writes the layout back as source). The passes after it
are built from the schedule it returns (aspc/cli/toolchain.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from aspc.ir.graph import LayoutChoice, ScheduleSpec, StageGraph, StageKind
from aspc.ir.layout import Knobs, apply_layout
from aspc.ir.layout_space import SHAPES
from aspc.passes.base import Pass, PassError
from aspc.passes.knob_space import KnobSpace, knob_space
from aspc.passes.layout_estimate import Estimate
from aspc.passes.layout_search import Ranked, runners_up, search, written_estimate


@dataclass(frozen=True)
class AutoPlace(Pass):
    name = "auto-place"
    bubble = "idle, tail and sync"
    runners_up: int = 3

    def apply(self, graph: StageGraph) -> StageGraph:
        if graph.stages_of(StageKind.WEIGHT_SYNC) or any(s.placement for s in graph.stages()):
            raise PassError("auto-place runs before `place` and the passes that follow it")
        space = knob_space(graph, graph.schedule.kind)
        ranked = search(graph, space=space)
        written = written_estimate(graph, space=space)
        best = ranked[0]
        choice = LayoutChoice(best.describe(), round(best.estimate.tps, 1),
                              round(best.estimate.efficiency, 3), round(written.tps, 1) if written else 0.0,
                              tuple(r.line() for r in runners_up(ranked, self.runners_up)),
                              why(graph, best, written, space))
        placed = apply_layout(graph, best.layout)
        stages = [s.with_results(layout=choice) if s.kind is StageKind.GENERATE else s for s in placed.stages()]
        placed = placed.rebuilt(stages, placed.flows())
        return placed.with_schedule(with_knobs(graph.schedule, best.knobs))


def with_knobs(schedule: ScheduleSpec, knobs: Knobs) -> ScheduleSpec:
    """The schedule with the settings auto-place chose (left unwritten: no span)."""
    if not knobs.options():
        return schedule
    return replace(schedule, options=tuple(sorted({**dict(schedule.options), **knobs.options()}.items())))


def why(graph: StageGraph, best: Ranked, written: Estimate | None, space: KnobSpace) -> str:
    e = best.estimate
    side = f"{e.bound}-bound: generation {e.gen_s:.1f} s, learner {e.learn_s:.1f} s a step"
    pinned = [f"{s.name}.{k}" for s in graph.stages() for k in SHAPES if s.option_span(k) is not None]
    gain = f"{e.tps / written.tps - 1:+.0%} over the written layout" if written else \
        "the written layout does not fit device memory"
    searched = f"; searched {space.bounds()}" if space.searched else ""
    return f"{side}; {gain}; pinned: {', '.join(pinned) or 'nothing'}{searched}"
