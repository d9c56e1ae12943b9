"""Checks of `placement = auto` programs: the search's bounds, and that some layout exists.

Under `placement = auto` the front end leaves the pool-size and memory checks of the generation and
training pools to the auto-place pass (resources.py); so that `aspc check` refuses what `aspc
compile` would, it asks the same feasibility rule the pass searches (aspc/ir/layout_space.py)
whether any layout fits, and points at what stops it.
"""
from __future__ import annotations

from aspc.frontend.diagnostics import DiagnosticSink
from aspc.frontend.schema import SEARCH_BOUNDS
from aspc.ir.graph import StageGraph, StageKind
from aspc.ir.layout import LayoutError
from aspc.ir.layout_space import iter_candidates, roles_of
from aspc.ir.span import Span

PINS = {"max_staleness": ("staleness",), "max_pack": ("pack",), "max_buckets": ("buckets",)}


def check_placement(graph: StageGraph, sink: DiagnosticSink) -> None:
    if graph.schedule is None:
        return
    auto = graph.schedule.option("placement") == "auto"
    _check_bounds(graph, auto, sink)
    if auto and not sink.errors:
        _check_placeable(graph, sink)


def _check_bounds(graph: StageGraph, auto: bool, sink: DiagnosticSink) -> None:
    schedule = graph.schedule
    for bound in SEARCH_BOUNDS:
        span = schedule.option_span(bound)
        if span is None:
            continue
        if not auto:
            sink.error(span, f"{bound} bounds the automatic placement's search, but the layout is written",
                       "add `placement = auto` to the schedule, or remove it")
            continue
        for pin, pin_span in _pins(graph, bound):
            sink.error(span, f"{bound} bounds a search of `{pin}`, but `{pin}` is written, which pins it",
                       f"remove `{pin}` to let the search choose it, or remove {bound}",
                       notes=[(pin_span, f"`{pin}` is written here")])
    _check_pack_bound(graph, sink)


def _pins(graph: StageGraph, bound: str) -> list[tuple[str, Span]]:
    """The written settings that pin what `bound` would search."""
    pins = [(name, graph.schedule.option_span(name)) for name in PINS[bound]]
    if bound == "max_pack":
        pins += [("micro_tokens", s.option_span("micro_tokens")) for s in graph.stages_of(StageKind.TRAIN)]
    return [(name, span) for name, span in pins if span is not None]


def _check_pack_bound(graph: StageGraph, sink: DiagnosticSink) -> None:
    bound, span = graph.schedule.option("max_pack"), graph.schedule.option_span("max_pack")
    longest = max((d.max_prompt + d.max_response for d in graph.data.values()), default=0)
    if span is not None and bound < longest:
        sink.error(span, f"max_pack = {bound} cannot hold one sequence of max_prompt + max_response = "
                         f"{longest} tokens", f"set max_pack to {longest} or more")


def _check_placeable(graph: StageGraph, sink: DiagnosticSink) -> None:
    try:
        roles = roles_of(graph)
        if next(iter_candidates(graph, roles), None) is not None:
            return
        message = ("no layout of the pools fits the pinned parallel degrees and device memory "
                   f"({roles.devices} devices of pools '{roles.gen_pool}' and '{roles.learn_pool}')")
        sink.error(_placement_span(graph), f"automatic placement: {message}",
                   "unpin a degree (remove a written tp/pp/ep), add devices, or write the layout",
                   notes=_pinned_notes(graph, roles))
    except LayoutError as error:
        sink.error(_where(graph, error.where), str(error),
                   "write the layout by hand (remove `placement = auto`) or change what the message names",
                   notes=[(_placement_span(graph), "`placement = auto` is asked for here")])


def _pinned_notes(graph: StageGraph, roles) -> list[tuple[Span, str]]:
    stages = (roles.gen, *roles.learners)
    return [(s.option_span(k), f"stage '{s.name}': {k} = {getattr(s.parallel, k)} is pinned here")
            for s in stages for k in ("tp", "pp", "cp", "ep") if s.option_span(k) is not None]


def _where(graph: StageGraph, name: str | None) -> Span:
    if name is not None and name in graph.pools and graph.pools[name].span is not None:
        return graph.pools[name].span
    stage = next((s for s in graph.stages() if s.name == name), None)
    return stage.span if stage is not None and stage.span is not None else _placement_span(graph)


def _placement_span(graph: StageGraph) -> Span:
    return graph.schedule.option_span("placement") or graph.schedule.span or Span.point("<schedule>")
