"""Resource checks: placements fit their pools, parallel layouts fit the model, memory fits HBM."""
from __future__ import annotations

import networkx as nx

from aspc.frontend.diagnostics import DiagnosticSink
from aspc.ir.graph import Stage, StageGraph, StageKind
from aspc.ir.memory import USABLE_HBM_FRACTION, MemoryNeed, forward_need, gb, generation_need, training_need
from aspc.frontend.idle_devices import warn_idle_devices
from aspc.frontend.placement_checks import check_placement
from aspc.frontend.overrides import override_span

_DEVICE_OPTIONS = ("tp", "pp", "dp", "cp", "ep")  # the parallel degrees that shape one instance


def check_resources(graph: StageGraph, sink: DiagnosticSink) -> None:
    placed = _auto_placed(graph)
    for stage in graph.stages():
        if stage.pool is None or stage.pool not in graph.pools:
            continue
        if stage.pool not in placed and not _fits_pool(graph, stage, sink):
            continue
        if graph.models.get(_model_of(stage)) is None:
            continue
        if _layout_ok(graph, stage, sink) and stage.pool not in placed:
            _fits_memory(graph, stage, sink)
        _warn_memory_share_on_cpu(graph, stage, sink)
    for stage in graph.stages_of(StageKind.TRAIN):
        _check_micro_tokens(graph, stage, sink)
    check_placement(graph, sink)
    if not sink.errors and not placed:
        warn_idle_devices(graph, sink)


def _auto_placed(graph: StageGraph) -> set[str]:
    """Under `placement = auto` the pools of generation and training get their sizes and layouts from
    the auto-place pass, which keeps to these same fit rules (aspc/ir/layout_space.py); placement_checks.py
    refuses a program no layout fits."""
    if graph.schedule is None or graph.schedule.option("placement") != "auto":
        return set()
    return {s.pool for s in graph.stages() if s.kind in (StageKind.GENERATE, StageKind.TRAIN) and s.pool}


def _fits_pool(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> bool:
    pool = graph.pools[stage.pool]
    if stage.devices <= pool.count:
        return True
    p = stage.parallel
    span = override_span(stage, ("instances", "tp", "pp", "dp", "cp")) or stage.span
    sink.error(span, f"stage '{stage.name}' needs {stage.devices} devices "
                           f"(instances {stage.instances} x tp {p.tp} x pp {p.pp} x dp {p.dp} x cp {p.cp}) "
                           f"but pool '{pool.name}' has {pool.count}",
               "lower instances or a parallel degree, or enlarge the pool",
               notes=[(pool.span, f"pool '{pool.name}' is declared here")])
    return False


def _model_of(stage: Stage) -> str | None:
    """The model a stage holds on its devices: its model input, or a reward stage's first model(...)
    or judge(...) source (the one the runtime loads: aspc/controller/kinds.py)."""
    if stage.kind is not StageKind.REWARD:
        return stage.model
    sources = stage.option("sources", ())
    scorers = [s for s in sources if s.func == "judge"] or [s for s in sources if s.func == "model"]
    return scorers[0].get("model") if scorers else None


def _decodes(stage: Stage) -> bool:
    """Generate and a judge (its verdict) decode with a vLLM layout and a KV cache; the rest run forward."""
    return stage.kind is StageKind.GENERATE or _is_judge(stage)


def _is_judge(stage: Stage) -> bool:
    return stage.kind is StageKind.REWARD and any(s.func == "judge" for s in stage.option("sources", ()))


def _layout_ok(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> bool:
    arch = graph.models[_model_of(stage)].arch
    p = stage.parallel
    problems = []  # (the option at fault, what is wrong)
    if arch.heads % p.tp:
        problems.append(("tp", f"tp = {p.tp} does not divide the {arch.heads} attention heads"))
    if p.pp > arch.layers:
        problems.append(("pp", f"pp = {p.pp} exceeds the {arch.layers} layers"))
    if p.ep > 1 and not arch.experts:
        problems.append(("ep", f"ep = {p.ep} needs a mixture-of-experts model, '{_model_of(stage)}' is dense"))
    elif arch.experts and arch.experts % p.ep:
        problems.append(("ep", f"ep = {p.ep} does not divide the {arch.experts} experts"))
    group = p.tp * p.dp * p.cp if _decodes(stage) else p.dp * p.cp
    if group % p.ep:
        what = "tp x dp x cp" if _decodes(stage) else "dp x cp"
        problems.append(("ep", f"ep = {p.ep} does not divide {what} = {group}"))
    for option, problem in problems:
        sink.error(stage.option_span(option) or stage.span, f"stage '{stage.name}': {problem}")
    return not problems


def _fits_memory(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    need = _memory_need(graph, stage)
    if need is None:
        return
    hardware = graph.pools[stage.pool].hardware
    fraction = _memory_fraction(stage)
    usable = hardware.hbm_bytes * fraction
    if need.total <= usable:
        return
    model = graph.models[_model_of(stage)]
    p = stage.parallel
    sink.error(_memory_span(stage, need.total <= hardware.hbm_bytes * USABLE_HBM_FRACTION),
               f"{_role_of(stage)} of '{model.name}' ({model.preset}, "
               f"{model.arch.total_params() / 1e9:.1f}B parameters) with tp={p.tp} pp={p.pp} "
               f"ep={p.ep} needs {gb(need.total)} per device ({need.describe()}), but a "
               f"{hardware.name} has {gb(usable)} usable ({fraction:.0%} of "
               f"{hardware.hbm_gib:g} GiB)",
               _memory_hint(stage, need.total / usable))


def _role_of(stage: Stage) -> str:
    if stage.kind is not StageKind.REWARD:
        return stage.kind.value
    return "judge" if _is_judge(stage) else "reward model"


def _memory_span(stage: Stage, fits_default_share: bool):
    """The option a memory error points at: a lowered gpu_memory_utilization when the default
    share would fit, else an overridden layout option, else the stage."""
    share = stage.option_span("gpu_memory_utilization")
    if share is not None and fits_default_share:
        return share
    return override_span(stage, (*_DEVICE_OPTIONS, "gpu_memory_utilization")) or stage.span


def _memory_fraction(stage: Stage) -> float:
    """The share of a device's memory the stage may take: a generate stage's
    gpu_memory_utilization, else the share the cost model also assumes (costmodel.toml)."""
    return stage.option("gpu_memory_utilization") or USABLE_HBM_FRACTION


def _memory_need(graph: StageGraph, stage: Stage) -> MemoryNeed | None:
    model = graph.models[_model_of(stage)]
    if stage.kind is StageKind.GENERATE:
        data = graph.data.get(stage.data)
        context = (data.max_prompt if data else 0) + stage.option("max_tokens", 0)
        return generation_need(model.arch, model.dtype, stage.parallel, context)
    if _is_judge(stage):
        return generation_need(model.arch, model.dtype, stage.parallel, _judge_context(graph))
    if stage.kind in (StageKind.REFERENCE, StageKind.REWARD):
        return forward_need(model.arch, model.dtype, stage.parallel)
    if stage.kind in (StageKind.TRAIN, StageKind.CRITIC):
        return training_need(model.arch, model.dtype, stage.parallel,
                             stage.option("distributed_optimizer", True))
    return None


# What a judge's context holds besides a sample: room for its rubric and its one verdict token, as
# its engine is lowered (backends/ascend/engine_args.py: JUDGE_RUBRIC_TOKENS + JUDGE_VERDICT_TOKENS).
JUDGE_EXTRA_TOKENS = 1024 + 1


def _judge_context(graph: StageGraph) -> int:
    """A judge reads the rubric, a prompt and its response: the longest of the program's data."""
    longest = max((d.max_prompt + d.max_response for d in graph.data.values()), default=0)
    return JUDGE_EXTRA_TOKENS + longest


def _memory_hint(stage: Stage, ratio: float) -> str:
    factor = 2
    while factor < ratio:
        factor *= 2
    target = stage.parallel.tp * factor
    raise_share = ", raise gpu_memory_utilization" if stage.option("gpu_memory_utilization", 1.0) < 1 else ""
    return f"shard it further, e.g. tp = {target} (or pp/ep){raise_share}, or use devices with more memory"


def _warn_memory_share_on_cpu(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    """The CPU runtime's KV cache is max_num_seqs (or a share of the step) whole sequences, not a
    share of memory: gpu_memory_utilization prices a simulation of a CPU pool but runs nothing."""
    span = stage.option_span("gpu_memory_utilization")
    if span is None or graph.pools[stage.pool].hardware.name != "cpu":
        return
    sink.warning(span, f"stage '{stage.name}': the CPU runtime does not use gpu_memory_utilization (its KV "
                       "cache holds whole sequences, as many as max_num_seqs); only `aspc simulate` reads it",
                 "bound the batch with max_num_seqs instead, or remove it")


def _check_micro_tokens(graph: StageGraph, stage: Stage, sink: DiagnosticSink) -> None:
    if stage.option_span("micro_tokens") is None and graph.schedule and graph.schedule.option("max_pack"):
        return  # auto-place chooses `pack`, which holds the longest sequence (placement_checks.py)
    for name in _data_upstream(graph, stage):
        data = graph.data[name]
        longest = data.max_prompt + data.max_response
        if stage.option("micro_tokens") < longest:
            sink.error(stage.option_span("micro_tokens") or stage.span,
                       f"micro_tokens = {stage.option('micro_tokens')} cannot hold one sequence of "
                       f"max_prompt + max_response = {longest} tokens",
                       f"set micro_tokens to {longest} or more")


def _data_upstream(graph: StageGraph, stage: Stage) -> list[str]:
    names = {graph.stage(n).data for n in nx.ancestors(graph.nx_graph(), stage.name)}
    return sorted(n for n in names if n in graph.data)
