"""Dataflow checks over the stage graph: inputs each kind needs, cycles, and RL consistency."""
from __future__ import annotations

import networkx as nx

from aspc.frontend.diagnostics import DiagnosticSink
from aspc.frontend.reward_hints import combine_rewards_hint
from aspc.ir.graph import DataSpec, Stage, StageGraph, StageKind
from aspc.ir.kinds import KIND_RULES
from aspc.ir.span import Span

_MAKE = {
    "responses": "stage gen = generate(MODEL, DATA)",
    "rewards": 'stage score = reward(gen, rule = "exact_match")',
    "advantages": "stage adv = advantage(score)",
    "ref_logprobs": "model ref = frozen(actor)` and `stage ref_lp = reference(ref, gen)",
    "values": "stage values = critic(CRITIC_MODEL, gen)",
}
GROUP_ESTIMATORS = ("grpo", "dapo", "rloo")


def check_cycles(graph: StageGraph, sink: DiagnosticSink) -> bool:
    if nx.is_directed_acyclic_graph(graph.nx_graph()):  # the common case, linear and cheap
        return True
    try:
        cycle = nx.find_cycle(graph.nx_graph())
    except nx.NetworkXNoCycle:
        return True
    names = [src for src, _ in cycle] + [cycle[0][0]]
    first = graph.stage(names[0])
    notes = [(graph.stage(n).span, f"'{n}' is part of the cycle") for n in names[1:-1]]
    sink.error(first.span, "stages form a cycle: " + " -> ".join(names),
               "dataflow must go one way; weights return to generation implicitly", notes)
    return False


def check_dataflow(graph: StageGraph, sink: DiagnosticSink) -> None:
    for kind, what in ((StageKind.GENERATE, "generate"), (StageKind.TRAIN, "train")):
        if not graph.stages_of(kind):
            sink.error(Span.point(_file(graph)), f"the pipeline has no {what} stage",
                       f"an RL pipeline generates responses and trains on them: add a {what} stage")
    for stage in graph.stages():
        _check_inputs(graph, stage, sink)
        _check_unused(graph, stage, sink)
    for stage in graph.stages_of(StageKind.TRAIN):
        _check_train(graph, stage, sink)
    for stage in graph.stages_of(StageKind.ADVANTAGE):
        _check_advantage(graph, stage, sink)
    _check_groups(graph, sink)
    trained = {t.model for t in graph.stages_of(StageKind.TRAIN)}
    for stage in graph.stages_of(StageKind.REFERENCE):
        _check_reference(stage, trained, sink)
    for stage in graph.stages_of(StageKind.ENVIRONMENT):
        _check_environment(graph, stage, sink)


def _file(graph: StageGraph) -> str:
    stages = graph.stages()
    return stages[0].span.file if stages and stages[0].span else "<input>"


def _check_inputs(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    seen: dict[str, str] = {}
    for src in graph.producers(stage.name):
        for field in graph.flow(src.name, stage.name).fields:
            if field not in KIND_RULES[stage.kind].accepts:
                sink.error(stage.span, f"a {stage.kind.value} stage does not take {field}, "
                                       f"but '{src.name}' ({src.kind.value}) is given as input")
            elif field in seen:
                sink.error(stage.span, f"stage '{stage.name}' gets {field} from both "
                                       f"'{seen[field]}' and '{src.name}'",
                           combine_rewards_hint(graph, seen[field], src.name, stage.name))
            seen[field] = src.name
    for field in sorted(KIND_RULES[stage.kind].requires - set(seen)):
        _missing(stage, field, "", sink)


def _missing(stage: Stage, field: str, why: str, sink: DiagnosticSink, cause: str | None = None) -> None:
    """A missing input; the error points at the option that asks for it (`cause`) when written."""
    span = (stage.option_span(cause) if cause else None) or stage.span
    sink.error(span, f"stage '{stage.name}' needs input '{field}'{why} but no stage provides it",
               f"add `{_MAKE[field]}` and pass it to '{stage.name}'")


def _check_unused(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    if stage.kind is not StageKind.TRAIN and not graph.consumers(stage.name):
        sink.warning(stage.span, f"nothing consumes the output of stage '{stage.name}'",
                     "pass it to a later stage, or remove it")


def _check_train(graph: StageGraph, train: Stage, sink: DiagnosticSink) -> None:
    inputs = graph.inputs(train.name)
    if train.option("kl") > 0 and "ref_logprobs" not in inputs:
        _missing(train, "ref_logprobs", f" (kl = {train.option('kl')})", sink, "kl")
    if (train.option("kl_reward") or 0) > 0 and "ref_logprobs" not in inputs:  # a loss option: absent at default
        _missing(train, "ref_logprobs", f" (kl_reward = {train.option('kl_reward')})", sink, "kl_reward")
    model = graph.models.get(train.model)
    if (train.option("routing_replay") or "none") != "none" and model is not None and not model.arch.experts:
        sink.error(train.option_span("routing_replay") or train.span,
                   f"routing_replay = {train.option('routing_replay')} replays the experts a mixture-of-experts "
                   f"model routed each token to, and '{train.model}' is dense", "remove routing_replay")
    if train.option("loss") == "ppo" and "values" not in inputs:
        _missing(train, "values", " (ppo needs a critic)", sink, "loss")
    if train.model in graph.models and graph.models[train.model].frozen_of:
        sink.error(train.span, f"stage '{train.name}' trains '{train.model}', which is frozen",
                   "train the model it is a frozen copy of")
    generator = _generator_of(graph, inputs.get("responses"))
    if generator is not None and generator.model != train.model:
        sink.error(train.span, f"stage '{train.name}' trains '{train.model}' on responses that "
                               f"'{generator.name}' generates with '{generator.model}'",
                   "on-policy RL trains the model that generates: use the same model in both")


def _check_advantage(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    if stage.option("estimator") == "gae" and "values" not in graph.inputs(stage.name):
        _missing(stage, "values", " (gae needs a critic)", sink, "estimator")


def _check_groups(graph: StageGraph, sink: DiagnosticSink) -> None:
    """Group-relative methods compare the responses of one prompt: their data needs group >= 2.
    One error per data set, at its `group`, with a note at each option that asks for groups."""
    users: dict[str, list[tuple[Stage, str]]] = {}
    for stage, option in _group_relative_options(graph):
        small = {generator.data for generator in _generators_upstream(graph, stage)
                 if generator.data in graph.data and graph.data[generator.data].group < 2}
        for name in small:
            users.setdefault(name, []).append((stage, option))
    for name, needs in sorted(users.items()):
        _group_too_small(graph.data[name], needs, sink)


_GROUP_OPTION = {StageKind.ADVANTAGE: "estimator", StageKind.TRAIN: "loss"}


def _group_relative_options(graph: StageGraph) -> list[tuple[Stage, str]]:
    """(stage, option name) for each advantage estimator and train loss that compares a group."""
    return [(s, _GROUP_OPTION[s.kind]) for s in graph.stages()
            if s.kind in _GROUP_OPTION and s.option(_GROUP_OPTION[s.kind]) in GROUP_ESTIMATORS]


def _group_too_small(data: DataSpec, needs: list[tuple[Stage, str]], sink: DiagnosticSink) -> None:
    users = [f"{option} {stage.option(option)} (stage '{stage.name}')" for stage, option in needs]
    notes = [_group_note(stage, option) for stage, option in needs]
    written = data.option_span("group")
    hint = "set group = 2 or more" if written else "add `group = 8` (2 or more) to the data block"
    sink.error(written or data.span,
               f"data '{data.name}' has group = {data.group}{'' if written else ' (the default)'}, "
               f"but {_and(users)} "
               f"compare{'s' if len(users) == 1 else ''} the responses within a prompt's group",
               hint, notes=notes)


def _group_note(stage: Stage, option: str) -> tuple[Span, str]:
    written = stage.option_span(option)
    what = f"stage '{stage.name}' uses {option} {stage.option(option)}"
    return (written, what + " here") if written else (stage.span, what + " (the default)")


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _generators_upstream(graph: StageGraph, stage: Stage) -> list[Stage]:
    ancestors = nx.ancestors(graph.nx_graph(), stage.name)
    return sorted((graph.stage(n) for n in ancestors if graph.stage(n).kind is StageKind.GENERATE),
                  key=lambda s: s.name)


def _generator_of(graph: StageGraph, name: str | None) -> Stage | None:
    """The GENERATE stage behind a responses input, through an environment if there is one."""
    while name is not None:
        stage = graph.stage(name)
        if stage.kind is StageKind.GENERATE:
            return stage
        name = graph.inputs(name).get("responses") if stage.kind is StageKind.ENVIRONMENT else None
    return None


def _check_reference(stage: Stage, trained: set[str], sink: DiagnosticSink) -> None:
    if stage.model in trained:
        sink.error(stage.span, f"stage '{stage.name}' takes log-probs from '{stage.model}', "
                               "which is being trained",
                   f"declare a frozen copy: `model ref = frozen({stage.model})`")


def _check_environment(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    source = graph.inputs(stage.name).get("responses")
    if source is not None and graph.stage(source).kind is not StageKind.GENERATE:
        sink.error(stage.span, f"an environment drives a generate stage, but '{source}' is a "
                               f"{graph.stage(source).kind.value} stage")
