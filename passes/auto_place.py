"""auto-place: the compiler chooses the layout (`schedule asp { placement = auto }`).

Removes: the bubbles a layout causes — one side idle waiting for the other (generation- or
learner-bound splits), instances below their saturated batch (tail), weight-sync and pool-switch
time — by searching the layouts of passes/layout_space.py with the closed-form objective of
passes/layout_estimate.py and rewriting pools and stages to the best one.
Assumes: one generate and one train stage; runs before `place` (which then places the chosen
layout). Every parallel degree the program writes is a constraint; the split, the generate
instances and the learner-side dp are the pass's to choose. It records its choice, the predicted
throughput, the written layout's prediction and the runners-up as a LayoutChoice on the generate
stage (`aspc inspect` shows it; `aspc tune` writes the layout back as source).
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.graph import LayoutChoice, StageGraph, StageKind
from aspc.ir.layout import Layout, StageLayout, apply_layout
from aspc.passes.base import Pass, PassError
from aspc.passes.layout_estimate import Estimate, Estimator
from aspc.passes.layout_space import SHAPES, Candidate, Roles, candidates, fits, roles_of


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    estimate: Estimate

    @property
    def layout(self) -> Layout:
        return self.candidate.layout

    def line(self) -> str:
        return f"{self.layout.describe()} {self.estimate.tps:.1f}"


@dataclass(frozen=True)
class AutoPlace(Pass):
    name = "auto-place"
    bubble = "idle, tail and sync"
    runners_up: int = 3

    def apply(self, graph: StageGraph) -> StageGraph:
        if graph.stages_of(StageKind.WEIGHT_SYNC) or any(s.placement for s in graph.stages()):
            raise PassError("auto-place runs before `place` and the passes that follow it")
        ranked = search(graph)
        written = written_estimate(graph)
        best = ranked[0]
        choice = LayoutChoice(best.layout.describe(), round(best.estimate.tps, 1),
                              round(best.estimate.efficiency, 3), round(written.tps, 1) if written else 0.0,
                              tuple(r.line() for r in ranked[1:1 + self.runners_up]), why(graph, best, written))
        placed = apply_layout(graph, best.layout)
        stages = [s.with_results(layout=choice) if s.kind is StageKind.GENERATE else s for s in placed.stages()]
        return placed.rebuilt(stages, placed.flows())


def search(graph: StageGraph, schedule: str | None = None) -> list[Ranked]:
    """Every candidate layout, best predicted throughput first (ties: the less device time wasted)."""
    roles = roles_of(graph)
    estimator = _estimator(graph, roles, schedule)
    found = candidates(graph, roles)
    if not found:
        raise PassError("no layout of the pools fits the pinned parallel degrees and device memory; "
                        "unpin a degree (remove a written tp/pp/ep) or add devices")
    ranked = [Ranked(c, estimator.estimate(c)) for c in found]
    return sorted(ranked, key=lambda r: (-round(r.estimate.tps, 3), -round(r.estimate.efficiency, 3),
                                         r.layout.describe()))


def written_estimate(graph: StageGraph, schedule: str | None = None) -> Estimate | None:
    """The cost model's figure for the layout as written; None if it does not fit device memory
    (a program under `placement = auto` may leave degrees unwritten that only the search sets)."""
    roles = roles_of(graph)
    candidate = written_candidate(graph, roles)
    if not fits(graph, roles, candidate.layout):
        return None
    return _estimator(graph, roles, schedule).estimate(candidate)


def written_candidate(graph: StageGraph, roles: Roles) -> Candidate:
    stages = tuple(StageLayout(s.name, s.pool, s.instances, s.parallel) for s in (roles.gen, *roles.learners))
    pools = tuple(sorted({(s.pool, graph.pools[s.pool].count) for s in stages}))
    gen = roles.gen
    return Candidate(Layout(pools, stages), gen.pool == roles.learn_pool, gen.instances, gen.parallel,
                     graph.pools[roles.learn_pool].count)


def why(graph: StageGraph, best: Ranked, written: Estimate | None) -> str:
    e = best.estimate
    side = f"{e.bound}-bound: generation {e.gen_s:.1f} s, learner {e.learn_s:.1f} s a step"
    pinned = [f"{s.name}.{k}" for s in graph.stages() for k in SHAPES if s.option_span(k) is not None]
    gain = f"{e.tps / written.tps - 1:+.0%} over the written layout" if written else \
        "the written layout does not fit device memory"
    return f"{side}; {gain}; pinned: {', '.join(pinned) or 'nothing'}"


def _estimator(graph: StageGraph, roles: Roles, schedule: str | None) -> Estimator:
    kind = schedule or graph.schedule.kind
    if kind != "asp":
        return Estimator(graph, roles, "sync", 0)
    written = graph.schedule.option("staleness") if graph.schedule.kind == "asp" else None
    return Estimator(graph, roles, "asp", 1 if written is None else written)
