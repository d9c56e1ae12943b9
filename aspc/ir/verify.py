"""IR invariants, checked after lowering and after every pass.

1. Every flow joins two stages, carries at least one field, and only fields its source produces.
2. Dataflow is acyclic; only `weights` flows (TRAIN -> generation) may close a loop.
3. Every stage's model, data and pool exist, and the model/data a kind needs are present.
4. A stage's instances x parallel devices fit its pool.
5. Every option value is a plain value (int, float, str, bool, tuple, Call or None).
6. Pass results sit on the stages they are for: a placement on a stage with a pool, within it;
   batching and partial rollout on GENERATE; micro-batch shapes on TRAIN, REFERENCE, CRITIC;
   streaming on the consumers of responses; a CHANNEL, DISPATCH or WEIGHT_SYNC has its record
   (and a weight transfer only a WEIGHT_SYNC) and no options: a pass-inserted node has no user
   options, everything on it is a pass's decision.
"""
from __future__ import annotations

import networkx as nx

from aspc.ir.graph import PRODUCES, Stage, StageGraph, StageKind
from aspc.ir.kinds import KIND_RULES, kinds_where
from aspc.ir.values import Call

# pass result -> the stage kinds it may sit on (placement: any stage with a pool)
_RESULT_KINDS = {
    "batching": {StageKind.GENERATE},
    "partial_rollout": {StageKind.GENERATE},
    "micro_batching": set(kinds_where(lambda r: r.packed)),
    "streaming": set(kinds_where(lambda r: r.streamed)),
    "channel": {StageKind.CHANNEL},
    "dispatch": {StageKind.DISPATCH},
    "weight_sync": {StageKind.WEIGHT_SYNC},
    "weight_transfer": {StageKind.WEIGHT_SYNC},
    "layout": {StageKind.GENERATE},
}
# the record a pass-inserted node cannot be without
_REQUIRED = {StageKind.CHANNEL: "channel", StageKind.DISPATCH: "dispatch", StageKind.WEIGHT_SYNC: "weight_sync"}


class VerificationError(Exception):
    """An IR invariant does not hold: a compiler bug, never a user error."""

    def __init__(self, problems: list[str], graph: StageGraph):
        self.problems = problems
        super().__init__("IR verification failed:\n  " + "\n  ".join(problems))


def verify(graph: StageGraph) -> None:
    problems = verify_problems(graph)
    if problems:
        raise VerificationError(problems, graph)


def verify_problems(graph: StageGraph) -> list[str]:
    problems: list[str] = []
    problems += _flow_problems(graph)
    problems += _cycle_problems(graph)
    for stage in graph.nx_graph().nodes:
        problems += _stage_problems(graph, graph.stage(stage), stage)
        problems += _result_problems(graph, graph.stage(stage))
        problems += _inserted_node_problems(graph, graph.stage(stage))
    return problems


def _result_problems(graph: StageGraph, stage: Stage) -> list[str]:
    problems = []
    where = f"{stage.kind.name} {stage.name}"
    required = _REQUIRED.get(stage.kind)
    if required is not None and getattr(stage, required) is None:
        problems.append(f"{where}: lacks its {required} record")
    if KIND_RULES[stage.kind].inserted and stage.options:
        problems.append(f"{where}: a pass-inserted node holds options {[k for k, _ in stage.options]}")
    for name, _ in stage.results():
        if name == "placement":
            if stage.pool is None:
                problems.append(f"{where}: placed, but it runs on no pool")
        elif stage.kind not in _RESULT_KINDS[name]:
            problems.append(f"{where}: a {name} result does not belong on a {stage.kind.name} stage")
    pool = graph.pools.get(stage.pool) if stage.placement is not None else None
    if pool is not None and not 0 <= stage.placement.device_offset <= pool.count - stage.devices:
        problems.append(f"{where}: placed at device {stage.placement.device_offset} with {stage.devices} "
                        f"devices, outside pool {pool.name} of {pool.count}")
    return problems


def _inserted_node_problems(graph: StageGraph, stage: Stage) -> list[str]:
    """CHANNEL: one producer, a capacity of (staleness + 1) steps. DISPATCH: one target.
    WEIGHT_SYNC: weights from one TRAIN stage to one GENERATE stage of the same model."""
    if not KIND_RULES[stage.kind].inserted or getattr(stage, _REQUIRED[stage.kind]) is None:
        return []  # a node without its record: _result_problems says so
    producers, consumers = graph.producers(stage.name), graph.consumers(stage.name)
    where = f"{stage.kind.name} {stage.name}"
    if stage.kind is StageKind.CHANNEL:
        channel = stage.channel
        if len(producers) != 1 or not consumers:
            return [f"{where}: needs one producer and at least one consumer"]
        if channel.capacity != (channel.staleness + 1) * channel.samples_per_step:
            return [f"{where}: capacity {channel.capacity} != (staleness + 1) x samples per step"]
    if stage.kind is StageKind.DISPATCH and [c.name for c in consumers] != [stage.dispatch.target]:
        return [f"{where}: must feed exactly its target '{stage.dispatch.target}'"]
    if stage.kind is StageKind.DISPATCH and not KIND_RULES[consumers[0].kind].dispatched:
        return [f"{where}: routes a {consumers[0].kind.name} stage, whose work no dispatch policy routes "
                "(the kind table: aspc/ir/kinds.py)"]
    if stage.kind is StageKind.WEIGHT_SYNC:
        kinds = ([p.kind for p in producers], [c.kind for c in consumers])
        if kinds != ([StageKind.TRAIN], [StageKind.GENERATE]):
            return [f"{where}: must carry weights from one TRAIN to one GENERATE stage"]
        if producers[0].model != consumers[0].model:
            return [f"{where}: trains '{producers[0].model}' but feeds '{consumers[0].model}'"]
    return []


def _flow_problems(graph: StageGraph) -> list[str]:
    problems = []
    for flow in graph.flows():
        source = graph.stage(flow.src)
        if not flow.fields:
            problems.append(f"flow {flow.src} -> {flow.dst} carries no field")
        produced = _produced_by(graph, source)
        extra = [f for f in flow.fields if produced is not None and f not in produced]
        if extra:
            problems.append(f"flow {flow.src} -> {flow.dst} carries {extra}, "
                            f"but {source.kind.name} {flow.src} produces {sorted(produced)}")
    return problems


def _produced_by(graph: StageGraph, stage: Stage) -> set[str] | None:
    """What a stage can send on: its own field, or (for a pass-inserted node) what it receives."""
    if KIND_RULES[stage.kind].inserted:
        return None
    return {PRODUCES[stage.kind]}


def _cycle_problems(graph: StageGraph) -> list[str]:
    if not graph.has_dataflow_cycle():
        return []
    forward = nx.subgraph_view(graph.nx_graph(),
                               filter_edge=lambda a, b: graph.flow(a, b).fields != ("weights",))
    try:
        cycle = nx.find_cycle(forward)
    except nx.NetworkXNoCycle:
        return []
    return ["dataflow cycle: " + " -> ".join(a for a, _ in cycle)]


def _awaiting_auto_place(graph: StageGraph) -> bool:
    """`placement = auto` before auto-place: the written layout is a starting point the pass replaces
    (the front end checks that some layout fits, frontend/placement_checks.py)."""
    return (graph.schedule is not None and graph.schedule.option("placement") == "auto"
            and not any(s.layout for s in graph.stages_of(StageKind.GENERATE)))


def _stage_problems(graph: StageGraph, stage: Stage, node: str) -> list[str]:
    problems = []
    where = f"stage {node} ({stage.kind.name})"
    if stage.name != node:
        problems.append(f"{where}: node id differs from its name '{stage.name}'")
    if KIND_RULES[stage.kind].needs_model and stage.model not in graph.models:
        problems.append(f"{where}: model '{stage.model}' is not declared")
    if KIND_RULES[stage.kind].needs_data and stage.data not in graph.data:
        problems.append(f"{where}: data '{stage.data}' is not declared")
    if stage.pool is not None:
        pool = graph.pools.get(stage.pool)
        if pool is None:
            problems.append(f"{where}: pool '{stage.pool}' is not declared")
        elif stage.devices > pool.count and not _awaiting_auto_place(graph):
            problems.append(f"{where}: needs {stage.devices} devices, pool has {pool.count}")
    problems += [f"{where}: option {k} holds {type(v).__name__}" for k, v in stage.options
                 if not _plain(v)]
    return problems


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, Call):
        return all(_plain(v) for _, v in value.kwargs)
    return value is None or isinstance(value, (int, float, str, bool))
