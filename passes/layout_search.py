"""The ranking `auto-place` and `aspc tune` share: every layout of aspc/ir/layout_space.py at every
setting of passes/knob_space.py, priced by passes/layout_estimate.py, best first.

Two stages: every layout at every staleness in closed form; then, where `pack` or `buckets` is
searched, the PACKED_LAYOUTS best layouts again at every (budget, buckets) pair with their
micro-batches packed. Among the entries of the best layout within SIMPLER_WITHIN of the best
prediction the simplest comes first: the least staleness (the least off-policy), the fewest
buckets (graph compiles are not priced), the smallest budget (activation memory is not priced).
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.graph import StageGraph
from aspc.ir.layout import Knobs, Layout, LayoutError, StageLayout
from aspc.ir.layout_space import Candidate, Roles, candidates, fits, roles_of
from aspc.passes.base import PassError
from aspc.passes.knob_space import KnobSpace, knob_space, longest_sequence, written_buckets, written_pack, \
    written_staleness
from aspc.passes.layout_estimate import Estimate, Estimator

PACKED_LAYOUTS = 4  # the best layouts whose micro-batch packings are priced (at every staleness)
SIMPLER_WITHIN = 0.005  # a setting this close to the best predicted throughput wins if it is simpler


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    estimate: Estimate
    knobs: Knobs = Knobs()
    staleness: int = 0  # the bound it was priced under (asp)
    packing: tuple[int, int] | None = None  # (token budget, buckets) it was priced with, if searched

    @property
    def layout(self) -> Layout:
        return self.candidate.layout

    def describe(self) -> str:
        knobs = self.knobs.describe()
        return f"{self.layout.describe()}; {knobs}" if knobs else self.layout.describe()

    def line(self) -> str:
        return f"{self.describe()} {self.estimate.tps:.1f}"


def search(graph: StageGraph, schedule: str | None = None, space: KnobSpace | None = None) -> list[Ranked]:
    """Every candidate layout at every staleness of the space, best predicted throughput first (ties:
    the less device time wasted); where the space searches pack or buckets, the best few of them at
    each packing, priced with its padding, and the simplest setting within SIMPLER_WITHIN first."""
    kind = schedule or graph.schedule.kind
    space = space or knob_space(graph, kind)
    roles, found = _space(graph)
    if not found:
        raise PassError("no layout of the pools fits the pinned parallel degrees and device memory; "
                        "unpin a degree (remove a written tp/pp/ep) or add devices")
    packings: dict = {}
    estimators = {k: _estimator(graph, roles, kind, k, packings) for k in space.staleness}
    ranked = _ordered([Ranked(c, e.estimate(c), space.knobs(k), k) for k, e in estimators.items() for c in found])
    if space.packing_searched:
        ranked = _ordered(_packed(estimators, space, _of_best_layouts(ranked, PACKED_LAYOUTS)))
    return _simplest_first(ranked)


def _of_best_layouts(ranked: list[Ranked], count: int) -> list[Ranked]:
    """The entries (every staleness) of the `count` best layouts."""
    best: list[Layout] = []
    for r in ranked:
        if len(best) == count:
            break
        if r.layout not in best:
            best.append(r.layout)
    return [r for r in ranked if r.layout in best]


def _space(graph: StageGraph) -> tuple[Roles, list[Candidate]]:
    try:
        roles = roles_of(graph)
        return roles, candidates(graph, roles)
    except LayoutError as error:
        raise PassError(str(error)) from None


def runners_up(ranked: list[Ranked], count: int) -> list[Ranked]:
    """The best of each other layout, staleness and token budget (a bucket count alone is no
    alternative worth a line), best first."""
    seen, out = {_group(ranked[0])}, []
    for r in ranked[1:]:
        if _group(r) not in seen and len(out) < count:
            seen.add(_group(r))
            out.append(r)
    return out


def _group(r: Ranked) -> tuple:
    return r.layout, r.staleness, r.packing[0] if r.packing else None


def _packed(estimators: dict[int, Estimator], space: KnobSpace, ranked: list[Ranked]) -> list[Ranked]:
    """Each of `ranked` at each packing of the space, priced with its padding."""
    return [Ranked(r.candidate, estimators[r.staleness].estimate(r.candidate, p), space.knobs(r.staleness, p),
                   r.staleness, p) for r in ranked for p in space.packings()]


def _ordered(ranked: list[Ranked]) -> list[Ranked]:
    return sorted(ranked, key=lambda r: (-round(r.estimate.tps, 3), -round(r.estimate.efficiency, 3),
                                         r.describe()))


def _simplest_first(ranked: list[Ranked]) -> list[Ranked]:
    """The best layout's simplest setting within SIMPLER_WITHIN of the best: the least staleness (the
    least off-policy), then the fewest buckets (graphs to compile: not priced), then the smallest
    budget (activation memory: not priced), first."""
    best = ranked[0]
    near = [r for r in ranked if r.layout == best.layout
            and r.estimate.tps >= (1 - SIMPLER_WITHIN) * best.estimate.tps]
    simplest = min(near, key=_simplicity)
    return [simplest, *(r for r in ranked if r is not simplest)]


def _simplicity(r: Ranked) -> tuple:
    pack, buckets = r.packing or (0, 0)
    return r.staleness, buckets, pack, -r.estimate.tps


def written_estimate(graph: StageGraph, schedule: str | None = None, space: KnobSpace | None = None) -> Estimate | None:
    """The cost model's figure for the layout and settings as written; None if the layout does not fit
    its pools or device memory (a program under `placement = auto` may leave degrees unwritten that
    only the search sets)."""
    written = written_ranked(graph, schedule, space)
    return written.estimate if written else None


def written_ranked(graph: StageGraph, schedule: str | None = None, space: KnobSpace | None = None) -> Ranked | None:
    """The written layout at the written settings (a searched budget: the default, or the least that
    holds the longest sequence), as a ranked entry; None if it does not fit."""
    kind = schedule or graph.schedule.kind
    space = space or knob_space(graph, kind)
    roles, _ = _space(graph)
    candidate = written_candidate(graph, roles)
    if not fits(graph, roles, candidate.layout):
        return None
    staleness = written_staleness(graph) if kind == "asp" else 0
    budget = max(written_pack(graph), longest_sequence(graph))  # a budget below it is searched, not written
    packing = (budget, written_buckets(graph) if kind == "asp" else 0) if space.packing_searched else None
    estimate = _estimator(graph, roles, kind, staleness).estimate(candidate, packing)
    return Ranked(candidate, estimate, space.knobs(staleness, packing), staleness, packing)


def written_candidate(graph: StageGraph, roles: Roles) -> Candidate:
    stages = tuple(StageLayout(s.name, s.pool, s.instances, s.parallel) for s in (roles.gen, *roles.learners))
    pools = tuple(sorted({(s.pool, graph.pools[s.pool].count) for s in stages}))
    gen = roles.gen
    return Candidate(Layout(pools, stages), gen.pool == roles.learn_pool, gen.instances, gen.parallel,
                     graph.pools[roles.learn_pool].count)


def _estimator(graph: StageGraph, roles: Roles, kind: str, staleness: int, packings: dict | None = None) -> Estimator:
    if kind != "asp":
        return Estimator(graph, roles, "sync", 0, packings)
    return Estimator(graph, roles, "asp", staleness, packings)
