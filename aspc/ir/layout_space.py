"""The layouts `auto-place` may choose for a program: its search space and its constraints.

Free: the device split between the generation pool and the learner pool (or one pool of both,
time-shared: colocated), the generate stage's instance count and, where not written, its tp/ep;
the learner-side stages' data-parallel degree and, where not written, the train stage's tp/pp/ep.
Pinned: every parallel degree the program writes (tp, pp, cp, ep, and a generate stage's dp), every
pool the generate and train stages do not use (a judge's pool keeps its size), the hardware.
`aspc tune` frees the written tp/pp/ep of the generate and train stages but those it is told to pin
(`unpinned`).
Every candidate fits device memory by the front end's own rules (aspc/ir/memory.py).
It lives in the IR so that the front end (`aspc check`) and the pass share one feasibility rule.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from collections.abc import Iterable, Iterator

from aspc.ir.graph import Parallel, Stage, StageGraph, StageKind
from aspc.ir.layout import Layout, LayoutError, StageLayout
from aspc.ir.memory import USABLE_HBM_FRACTION, forward_need, generation_need, training_need

DEGREES = (1, 2, 4, 8)  # tensor / expert degrees tried where not written (within one node)
PIPELINE = (1, 2, 4)  # training pipeline degrees tried where not written
SHAPES = ("tp", "pp", "cp", "ep")
LEARNER_KINDS = (StageKind.TRAIN, StageKind.REFERENCE, StageKind.CRITIC, StageKind.REWARD)


@dataclass(frozen=True)
class Roles:
    """The program's generate stage, its learner-side device stages, and the two pools."""

    gen: Stage
    learners: tuple[Stage, ...]
    gen_pool: str
    learn_pool: str
    devices: int  # of the two pools together


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    colocated: bool
    gen_instances: int
    gen_parallel: Parallel
    learn_devices: int


def roles_of(graph: StageGraph) -> Roles:
    gens = graph.stages_of(StageKind.GENERATE)
    trains = graph.stages_of(StageKind.TRAIN)
    if len(gens) != 1 or len(trains) != 1:
        extra = (gens[1:] or trains[1:] or gens or trains or [None])[0]
        raise LayoutError("automatic placement handles one generate and one train stage; place the others "
                          "by hand (remove `placement = auto`)", extra.name if extra else None)
    gen, train = gens[0], trains[0]
    pools = {gen.pool, train.pool}
    learners = tuple(s for s in graph.stages() if s.pool in pools and s is not gen and s.pool is not None)
    other = next((s for s in learners if s.kind not in LEARNER_KINDS), None)
    if other is not None:
        raise LayoutError("automatic placement moves only generate, reward, reference, critic and train stages",
                          other.name)
    beside = next((s for s in learners if gen.pool != train.pool and s.pool == gen.pool), None)
    if beside is not None:
        raise LayoutError(f"pool '{gen.pool}' hosts learner-side stages beside generation; put them on "
                          f"'{train.pool}' or place by hand", beside.name)
    kinds = {graph.pools[p].hardware.name for p in pools}
    if len(kinds) > 1:
        raise LayoutError(f"pools '{gen.pool}' and '{train.pool}' are different hardware: the split between "
                          "them is not free", train.pool)
    if kinds == {"cpu"}:
        raise LayoutError("automatic placement prices layouts with the roofline model of accelerators; a cpu "
                          "pool's costs are measured (docs/simulator.md, calibration): write its layout", gen.pool)
    return Roles(gen, learners, gen.pool, train.pool, sum(graph.pools[p].count for p in pools))


SEARCHED = {StageKind.GENERATE: ("tp", "ep"), StageKind.TRAIN: ("tp", "pp", "ep")}  # what gen_shapes, train_shapes try


def unpinned(graph: StageGraph, pins: Iterable[str] = ()) -> StageGraph:
    """The graph with the generate and train stages' written degrees that the search tries (SEARCHED)
    left to it (`aspc tune`: a written degree is where the search starts, not a constraint), except
    the `pins`: a degree ("tp": every stage's) or a stage's ("gen.tp"). Other stages keep theirs."""
    kept = set(pins)
    out = graph
    for stage in _searched_stages(graph):
        freed = {k for k in SEARCHED[stage.kind] if k not in kept and f"{stage.name}.{k}" not in kept}
        spans = tuple((k, span) for k, span in stage.option_spans if k not in freed)
        if spans != stage.option_spans:
            out = out.with_stage(replace(stage, option_spans=spans))
    return out


def pin_names(graph: StageGraph) -> set[str]:
    """What `unpinned` accepts as a pin for this graph."""
    return {k for names in SEARCHED.values() for k in names} | \
        {f"{s.name}.{k}" for s in _searched_stages(graph) for k in SEARCHED[s.kind]}


def _searched_stages(graph: StageGraph) -> list[Stage]:
    return graph.stages_of(StageKind.GENERATE) + graph.stages_of(StageKind.TRAIN)


def candidates(graph: StageGraph, roles: Roles) -> list[Candidate]:
    """Every layout of the search space that fits memory, colocated and separate."""
    return list(iter_candidates(graph, roles))


def iter_candidates(graph: StageGraph, roles: Roles) -> Iterator[Candidate]:
    learn_names = _learner_pool_names(roles)
    for gen_par in gen_shapes(graph, roles.gen):
        size = gen_par.devices
        for train_par in train_shapes(graph, roles):
            rank = train_par.tp * train_par.pp * train_par.cp
            for learn in range(rank, roles.devices - size + 1, rank):
                layout = _separate(graph, roles, learn_names, gen_par, train_par, learn)
                if layout is not None:
                    yield Candidate(layout, False, layout.stage(roles.gen.name).instances, gen_par, learn)
            colocated = _colocated(graph, roles, gen_par, train_par)
            if colocated is not None:
                yield Candidate(colocated, True, colocated.stage(roles.gen.name).instances, gen_par, roles.devices)


def gen_shapes(graph: StageGraph, gen: Stage) -> list[Parallel]:
    model = graph.models[gen.model]
    arch, hw = model.arch, graph.pools[gen.pool].hardware
    data = graph.data.get(gen.data)
    context = (data.max_prompt if data else 0) + gen.option("max_tokens", 0)
    usable = hw.hbm_bytes * (gen.option("gpu_memory_utilization") or USABLE_HBM_FRACTION)
    out = []
    for tp, ep in itertools.product(_choices(gen, "tp", DEGREES), _choices(gen, "ep", DEGREES)):
        par = replace(gen.parallel, tp=tp, ep=ep)
        if arch.heads % tp or tp > hw.scale_up_devices or _bad_ep(arch, ep, tp * par.dp * par.cp):
            continue
        if generation_need(arch, model.dtype, par, context).total <= usable:
            out.append(par)
    return out


def train_shapes(graph: StageGraph, roles: Roles) -> list[Parallel]:
    """tp x pp x cp x ep of the train stage (dp comes with the split)."""
    train = next(s for s in roles.learners if s.kind is StageKind.TRAIN)
    arch, hw = graph.models[train.model].arch, graph.pools[train.pool].hardware
    out = []
    for tp, pp, ep in itertools.product(_choices(train, "tp", DEGREES), _choices(train, "pp", PIPELINE),
                                        _choices(train, "ep", DEGREES)):
        if arch.heads % tp or tp > hw.scale_up_devices or pp > arch.layers or (ep > 1 and not arch.experts):
            continue
        out.append(replace(train.parallel, tp=tp, pp=pp, ep=ep, dp=1))
    return out


def _choices(stage: Stage, name: str, tried: tuple[int, ...]) -> tuple[int, ...]:
    """The written degree alone where pinned; else the tried ones and the stage's own (a freed written
    degree outside them: pp = 6, ep = 64)."""
    own = getattr(stage.parallel, name)
    return (own,) if stage.option_span(name) is not None else tuple(sorted({*tried, own}))


def _bad_ep(arch, ep: int, group: int) -> bool:
    if not arch.experts:
        return ep > 1
    return bool(arch.experts % ep or group % ep)


def _learner_pool_names(roles: Roles) -> tuple[str, str]:
    """(generation pool, learner pool) names for a separate layout; a program written colocated
    gets a second pool for its learner side."""
    if roles.gen_pool != roles.learn_pool:
        return roles.gen_pool, roles.learn_pool
    return roles.gen_pool, f"{roles.gen_pool}_learner"


def _separate(graph, roles: Roles, names, gen_par: Parallel, train_par: Parallel, learn: int) -> Layout | None:
    gen_devices = roles.devices - learn
    instances = gen_devices // gen_par.devices
    if instances < 1 or instances * gen_par.devices != gen_devices:
        return None
    stages = _learner_layouts(graph, roles, names[1], train_par, learn)
    if stages is None:
        return None
    gen = StageLayout(roles.gen.name, names[0], instances, gen_par)
    return Layout(((names[0], gen_devices), (names[1], learn)), (gen, *stages))


def _colocated(graph, roles: Roles, gen_par: Parallel, train_par: Parallel) -> Layout | None:
    pool = roles.learn_pool
    instances = roles.devices // gen_par.devices
    stages = _learner_layouts(graph, roles, pool, train_par, roles.devices)
    if stages is None or instances < 1:
        return None
    return Layout(((pool, roles.devices),), (StageLayout(roles.gen.name, pool, instances, gen_par), *stages))


def _learner_layouts(graph, roles: Roles, pool: str, train_par: Parallel, devices: int):
    """Each learner-side stage spread data-parallel over the learner devices (time-shared), at its
    written shape or the train stage's; None if one does not divide them or does not fit memory."""
    out = []
    for stage in roles.learners:
        par = train_par if stage.kind is StageKind.TRAIN else _follow(stage, train_par)
        rank = par.tp * par.pp * par.cp
        if devices % rank:
            return None
        if stage.instances > 1:  # a judge or several reward-model workers: more of them
            out.append(StageLayout(stage.name, pool, devices // stage.parallel.devices, stage.parallel))
            continue
        par = replace(par, dp=devices // rank)
        if (par.dp * par.cp) % par.ep or not _fits(graph, stage, par):
            return None
        out.append(StageLayout(stage.name, pool, 1, par))
    return out


def _follow(stage: Stage, train_par: Parallel) -> Parallel:
    """A forward stage's shape: what it writes, else the train stage's (weights laid out alike)."""
    values = {k: getattr(stage.parallel if stage.option_span(k) is not None else train_par, k) for k in SHAPES}
    return replace(stage.parallel, **values)


def _fits(graph: StageGraph, stage: Stage, par: Parallel) -> bool:
    if stage.model is None:
        return True
    model = graph.models[stage.model]
    usable = graph.pools[stage.pool].hardware.hbm_bytes * USABLE_HBM_FRACTION
    if stage.kind is StageKind.REFERENCE:
        need = forward_need(model.arch, model.dtype, par)
    else:
        need = training_need(model.arch, model.dtype, par, stage.option("distributed_optimizer", True))
    return need.total <= usable


def fits(graph: StageGraph, roles: Roles, layout: Layout) -> bool:
    """Whether every stage of a layout fits its pool and device memory (the rules the candidates keep to)."""
    sizes = dict(layout.pools)
    if any(s.instances * s.parallel.devices > sizes.get(s.pool, 0) for s in layout.stages):
        return False
    gen = layout.stage(roles.gen.name)
    if gen is None or gen.parallel not in gen_shapes(graph, replace(roles.gen, parallel=gen.parallel)):
        return False
    return all(_fits(graph, graph.stage(s.stage), s.parallel) for s in layout.stages if s.stage != roles.gen.name)
