"""The stage-graph IR: typed, frozen records over a networkx.DiGraph.

Nodes are stages; edges are dataflow carrying named fields. Pools, models and data are
graph-level tables. Passes never read `G.nodes[n][...]`: they use the accessors here, and every
change returns a new StageGraph. What the passes decide about a stage is a typed record on it
(`Stage.placement`, `micro_batching`, ...; see RESULTS), never a key among its user options.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from collections.abc import Iterable

import networkx as nx

from aspc.ir.facts import Hardware, ModelArch
from aspc.ir.kinds import KIND_RULES, StageKind
from aspc.ir.span import Span
from aspc.ir.values import Call


# Fields a flow may carry: prompts (DISPATCH -> GENERATE) and what each user stage produces.
PROMPTS = "prompts"
WEIGHTS = "weights"

# The field each user stage produces (the kind table's); a flow carries some of its producer's fields.
PRODUCES: dict[StageKind, str] = {r.kind: r.produces for r in KIND_RULES.values() if r.produces is not None}


def _span() -> Any:
    return field(default=None, compare=False, repr=False)


def _option_spans() -> Any:
    """Where each explicit option was written (`name = value` in the file, or `--set`), by name:
    checks point their errors at the option that causes them. Not part of equality."""
    return field(default=(), compare=False, repr=False)


def _span_of(option_spans: tuple[tuple[str, Span], ...], name: str) -> Span | None:
    return next((span for key, span in option_spans if key == name), None)


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def devices(self) -> int:
        """Devices of one instance; expert parallelism reuses the tp x cp x dp devices."""
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self) -> str:
        return " ".join(f"{k}={getattr(self, k)}" for k in ("tp", "pp", "dp", "cp", "ep"))


@dataclass(frozen=True)
class PoolSpec:
    name: str
    hardware: Hardware
    count: int
    span: Span | None = _span()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    preset: str  # a preset name, or "custom"
    arch: ModelArch
    dtype: str
    checkpoint: str = ""
    seed: int = 0
    frozen_of: str | None = None  # `frozen(actor)`: a fixed copy of another model
    span: Span | None = _span()


@dataclass(frozen=True)
class DataSpec:
    name: str
    source: str  # "jsonl" | "synthetic"
    location: str  # file path (relative to the .aspl file) or synthetic task name
    prompts_per_step: int
    group: int
    max_prompt: int
    max_response: int
    seed: int = 0
    size: int = 0  # synthetic prompts generated (0 for jsonl)
    response_lengths: Call | None = None
    prompt_lengths: Call | None = None
    span: Span | None = _span()
    option_spans: tuple[tuple[str, Span], ...] = _option_spans()

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group

    def option_span(self, name: str) -> Span | None:
        return _span_of(self.option_spans, name)


@dataclass(frozen=True)
class ScheduleSpec:
    kind: str  # "asp" | "sync" | "sync-naive"
    options: tuple[tuple[str, Any], ...] = ()
    span: Span | None = _span()
    option_spans: tuple[tuple[str, Span], ...] = _option_spans()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def option_span(self, name: str) -> Span | None:
        return _span_of(self.option_spans, name)


# ---- pass results: what the passes decide about a stage, as typed records ----
# User-written options (what the .aspl file says, defaults filled in) stay in `Stage.options`;
# a pass records its decision in one of the typed, optional fields below (None: not decided).

PlacementKind = Literal["dedicated", "time_shared"]
BatchingMode = Literal["continuous", "static"]
SyncMode = Literal["sync", "async"]
TransferRoute = Literal["link", "offload_onload"]


@dataclass(frozen=True)
class Placement:
    """`place`: the stage's instances lie on devices device_offset .. of its pool, side by side
    with the pool's other stages (dedicated) or sharing them from device 0 (time_shared)."""

    kind: PlacementKind
    device_offset: int


@dataclass(frozen=True)
class Batching:
    """`continuous-batching` on GENERATE: how an instance batches decoding (absent: static)."""

    mode: BatchingMode


@dataclass(frozen=True)
class MicroBatchShape:
    """`pack` on TRAIN, REFERENCE and CRITIC: micro-batches of at most `tokens`, balanced across
    dp ranks, padded to one of `buckets` (() : dynamic shapes, padding "none")."""

    tokens: int
    buckets: tuple[int, ...]
    balance: str
    padding: str  # "buckets" | "none"
    padding_fraction: float | None = None  # expected, with buckets


@dataclass(frozen=True)
class Streaming:
    """`stream` on a consumer: it takes micro-batches of `micro` samples as they arrive."""

    micro: int


@dataclass(frozen=True)
class PartialRollout:
    """`partial-rollout` on GENERATE: a sample may be split at most `max_split` times at syncs."""

    max_split: int


@dataclass(frozen=True)
class ChannelSpec:
    """`async-decouple` on CHANNEL: a bounded buffer of (staleness + 1) steps of samples."""

    capacity: int
    samples_per_step: int
    staleness: int


@dataclass(frozen=True)
class DispatchSpec:
    """`queue-aware-dispatch` on DISPATCH: how work is sent to the instances of `target`."""

    target: str
    policy: str
    group_affinity: bool
    instances: int


@dataclass(frozen=True)
class WeightSyncSpec:
    """WEIGHT_SYNC semantics: a barrier (sync) or under the staleness bound (async,
    `async-decouple`); `interrupt`: in-flight generations pause at the sync (`partial-rollout`)."""

    mode: SyncMode
    staleness: int
    interrupt: bool = False


@dataclass(frozen=True)
class WeightTransfer:
    """`place` on WEIGHT_SYNC: the bytes to move, the train and generate layouts and the route."""

    bytes: int
    src_layout: str
    dst_layout: str
    reshard: bool
    transfer: TransferRoute


@dataclass(frozen=True)
class LayoutChoice:
    """`auto-place` on GENERATE: the layout it chose (aspc/ir/layout.py), the cost model's
    prediction for it (e2e tokens/s per device, bubble-free share), the written layout's, the best
    runners-up, and why it wins (the binding side, what was pinned)."""

    chosen: str
    predicted_tps: float
    predicted_efficiency: float
    written_tps: float
    runners_up: tuple[str, ...]
    why: str


# Stage field -> its record type, in the order they print.
RESULTS: dict[str, type] = {
    "placement": Placement, "batching": Batching, "micro_batching": MicroBatchShape,
    "streaming": Streaming, "partial_rollout": PartialRollout, "channel": ChannelSpec,
    "dispatch": DispatchSpec, "weight_sync": WeightSyncSpec, "weight_transfer": WeightTransfer,
    "layout": LayoutChoice,
}


@dataclass(frozen=True)
class Stage:
    name: str
    kind: StageKind
    model: str | None = None
    data: str | None = None
    pool: str | None = None
    instances: int = 1
    parallel: Parallel = Parallel()
    options: tuple[tuple[str, Any], ...] = ()  # kind-specific, sorted by name, defaults filled in
    span: Span | None = _span()
    option_spans: tuple[tuple[str, Span], ...] = _option_spans()
    # pass results (see RESULTS); None until the pass that decides them runs
    placement: Placement | None = None
    batching: Batching | None = None
    micro_batching: MicroBatchShape | None = None
    streaming: Streaming | None = None
    partial_rollout: PartialRollout | None = None
    channel: ChannelSpec | None = None
    dispatch: DispatchSpec | None = None
    weight_sync: WeightSyncSpec | None = None
    weight_transfer: WeightTransfer | None = None
    layout: LayoutChoice | None = None

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def option_span(self, name: str) -> Span | None:
        return _span_of(self.option_spans, name)

    @property
    def devices(self) -> int:
        return self.instances * self.parallel.devices

    def with_results(self, **results: Any) -> Stage:
        """A copy with these pass results set (field name -> record, or None to clear)."""
        for name, value in results.items():
            if name not in RESULTS:
                raise TypeError(f"{name} is not a pass result; results: {', '.join(RESULTS)}")
            if value is not None and not isinstance(value, RESULTS[name]):
                raise TypeError(f"{name} must be a {RESULTS[name].__name__}, got {type(value).__name__}")
        return replace(self, **results)

    def results(self) -> list[tuple[str, Any]]:
        """The pass results this stage has, as (field, record), in RESULTS order."""
        return [(name, getattr(self, name)) for name in RESULTS if getattr(self, name) is not None]


@dataclass(frozen=True)
class Flow:
    src: str
    dst: str
    fields: tuple[str, ...]


class StageGraph:
    """A pipeline: stages and flows plus the pools, models, data and schedule they refer to."""

    def __init__(self, pipeline: str, pools: Iterable[PoolSpec] = (), models: Iterable[ModelSpec] = (),
                 data: Iterable[DataSpec] = (), schedule: ScheduleSpec | None = None,
                 stages: Iterable[Stage] = (), flows: Iterable[Flow] = ()):
        self.pipeline = pipeline
        self.pools = {p.name: p for p in pools}
        self.models = {m.name: m for m in models}
        self.data = {d.name: d for d in data}
        self.schedule = schedule or ScheduleSpec("asp")
        self._graph = nx.DiGraph()
        self._graph.add_nodes_from((stage.name, {"stage": stage}) for stage in stages)
        self._graph.add_edges_from((flow.src, flow.dst, {"flow": flow}) for flow in flows)
        self._ordered: list[Stage] | None = None  # cached stage order; builders make new graphs
        self._acyclic = True  # known once the order is: whether the dataflow has no cycle

    # -- reading --
    def stage(self, name: str) -> Stage:
        return self._graph.nodes[name]["stage"]

    def has_stage(self, name: str) -> bool:
        return name in self._graph

    def stages(self) -> list[Stage]:
        """Stages in a deterministic order: topological (weight back edges ignored), then by name.
        A graph with a dataflow cycle (invalid; the verifier reports it) is ordered by name."""
        if self._ordered is None:
            order = _topological_order(self._graph)
            self._acyclic = order is not None
            nodes = self._graph.nodes
            self._ordered = [nodes[n]["stage"] for n in (order or sorted(self._graph.nodes))]
        return list(self._ordered)

    def has_dataflow_cycle(self) -> bool:
        """Whether stages feed each other in a loop (weight back edges are not dataflow)."""
        self.stages()
        return not self._acyclic

    def stages_of(self, kind: StageKind) -> list[Stage]:
        return [s for s in self.stages() if s.kind is kind]

    def flows(self) -> list[Flow]:
        rank = {s.name: i for i, s in enumerate(self.stages())}
        edges = (self._graph.edges[e]["flow"] for e in self._graph.edges)
        return sorted(edges, key=lambda f: (rank[f.src], rank[f.dst]))

    def flow(self, src: str, dst: str) -> Flow | None:
        return self._graph.edges[src, dst]["flow"] if self._graph.has_edge(src, dst) else None

    def producers(self, name: str) -> list[Stage]:
        return sorted((self.stage(n) for n in self._graph.predecessors(name)), key=lambda s: s.name)

    def consumers(self, name: str) -> list[Stage]:
        return sorted((self.stage(n) for n in self._graph.successors(name)), key=lambda s: s.name)

    def inputs(self, name: str) -> dict[str, str]:
        """Field -> producing stage, for every field flowing into a stage."""
        return {f: src.name for src in self.producers(name) for f in self.flow(src.name, name).fields}

    def nx_graph(self) -> nx.DiGraph:
        """A read-only view, for analyses that want networkx algorithms."""
        return self._graph.copy(as_view=True)

    # -- building (each returns a new graph) --
    def copy(self) -> StageGraph:
        new = StageGraph(self.pipeline, self.pools.values(), self.models.values(), self.data.values(),
                         self.schedule)
        new._graph = self._graph.copy()
        return new

    def with_stage(self, stage: Stage) -> StageGraph:
        new = self.copy()
        new._graph.add_node(stage.name, stage=stage)
        return new

    def with_flow(self, flow: Flow) -> StageGraph:
        new = self.copy()
        new._graph.add_edge(flow.src, flow.dst, flow=flow)
        return new

    def without_flow(self, src: str, dst: str) -> StageGraph:
        new = self.copy()
        new._graph.remove_edge(src, dst)
        return new

    def rebuilt(self, stages: Iterable[Stage], flows: Iterable[Flow]) -> StageGraph:
        """A new graph with the same pools, models, data and schedule, and these stages and flows."""
        return StageGraph(self.pipeline, self.pools.values(), self.models.values(), self.data.values(),
                          self.schedule, stages, flows)

    def with_schedule(self, schedule: ScheduleSpec) -> StageGraph:
        new = self.copy()
        new.schedule = schedule
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageGraph):
            return NotImplemented
        return (self.pipeline, self.pools, self.models, self.data, self.schedule,
                self.stages(), self.flows()) == (other.pipeline, other.pools, other.models,
                                                 other.data, other.schedule, other.stages(),
                                                 other.flows())

    __hash__ = None  # mutable-looking container semantics: not hashable


def _topological_order(graph: nx.DiGraph) -> list[str] | None:
    """The order of networkx's lexicographical_topological_sort over the dataflow edges, in one
    linear pass without a filtered view; None when the dataflow has a cycle."""
    forward = {n: [m for m, edge in graph.succ[n].items() if not _is_back_edge(edge)] for n in graph}
    waiting = dict.fromkeys(graph, 0)  # inputs not yet placed
    for targets in forward.values():
        for target in targets:
            waiting[target] += 1
    ready = [n for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        name = heapq.heappop(ready)
        order.append(name)
        for target in forward[name]:
            waiting[target] -= 1
            if waiting[target] == 0:
                heapq.heappush(ready, target)
    return order if len(order) == len(waiting) else None


def _is_back_edge(edge: dict) -> bool:
    """Weight flows from TRAIN back to generation close the RL loop; they are not dataflow."""
    return edge["flow"].fields == ("weights",)
