"""The canonical text form of the IR: one deterministic truth for golden tests and diffs.

A stage prints its user options in braces, then each pass result after a `|`:
`stage update = TRAIN(actor) on learner x1 [...] {lr=1e-06, ...} | placement: time_shared @0 | ...`.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from aspc.ir.facts import ModelArch
from aspc.ir.graph import (Batching, ChannelSpec, DataSpec, DispatchSpec, LayoutChoice, MicroBatchShape, ModelSpec,
                           PartialRollout, Placement, PoolSpec, Stage, StageGraph, Streaming, WeightSyncSpec,
                           WeightTransfer)
from aspc.ir.values import format_value

_ARCH_DEFAULTS = ModelArch(1, 1, 1, 1, 1, 1, 1)


def print_ir(graph: StageGraph) -> str:
    lines = [f"pipeline {graph.pipeline}", _schedule(graph)]
    lines += [_pool(p) for _, p in sorted(graph.pools.items())]
    lines += [_model(m) for _, m in sorted(graph.models.items())]
    lines += [_data(d) for _, d in sorted(graph.data.items())]
    lines += [_stage(s) for s in graph.stages()]
    lines += [f"flow {f.src} -> {f.dst} : {', '.join(f.fields)}" for f in graph.flows()]
    return "\n".join(lines) + "\n"


def _options(pairs) -> str:
    body = ", ".join(f"{k}={format_value(v)}" for k, v in pairs if v is not None)
    return f" {{{body}}}" if body else ""


def _schedule(graph: StageGraph) -> str:
    return f"schedule {graph.schedule.kind}{_options(graph.schedule.options)}"


def _pool(pool: PoolSpec) -> str:
    return f"pool {pool.name} = {pool.hardware.name} x {pool.count}"


def _model(model: ModelSpec) -> str:
    arch = model.arch
    shape = [(f.name, getattr(arch, f.name)) for f in fields(arch)
             if getattr(arch, f.name) != getattr(_ARCH_DEFAULTS, f.name) or f.name in
             ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")]
    source = f"frozen({model.frozen_of})" if model.frozen_of else model.preset
    params = f"params={_count(arch.total_params())}"
    if arch.experts:
        params += f" active={_count(arch.active_params())}"
    extra = [("dtype", model.dtype), ("checkpoint", model.checkpoint or None), ("seed", model.seed)]
    return f"model {model.name} = {source} [{params}]{_options(extra + shape)}"


def _count(n: int) -> str:
    if n >= 100_000_000:
        return f"{n / 1e9:.3f}B"
    return f"{n / 1e6:.3f}M" if n >= 100_000 else str(n)


def _data(data: DataSpec) -> str:
    pairs = [(k, getattr(data, k)) for k in ("prompts_per_step", "group", "max_prompt",
                                             "max_response", "seed", "response_lengths",
                                             "prompt_lengths")]
    if data.source == "synthetic":
        pairs.append(("size", data.size))
    return f"data {data.name} = {data.source}({format_value(data.location)}){_options(sorted(pairs))}"


def _stage(stage: Stage) -> str:
    inputs = ", ".join(x for x in (stage.model, stage.data) if x)
    inputs = f"({inputs})" if inputs else ""
    placement = ""
    if stage.pool is not None:
        placement = f" on {stage.pool} x{stage.instances} [{stage.parallel}]"
    results = "".join(f" | {name}: {_result(record)}" for name, record in stage.results())
    return f"stage {stage.name} = {stage.kind.name}{inputs}{placement}{_options(stage.options)}{results}"


def _result(record: Any) -> str:
    """One pass result, readably: `time_shared @0`, `tokens=8192 buckets=[...] ...`."""
    match record:
        case Placement(kind, offset):
            return f"{kind} @{offset}"
        case Batching(mode):
            return mode
        case MicroBatchShape(tokens, buckets, balance, padding, fraction):
            text = f"tokens={tokens} buckets={format_value(buckets)} balance={balance} padding={padding}"
            return text + (f" padding_fraction={fraction}" if fraction is not None else "")
        case Streaming(micro):
            return f"micro={micro}"
        case PartialRollout(max_split):
            return f"max_split={max_split}"
        case ChannelSpec(capacity, per_step, staleness):
            return f"capacity={capacity} samples_per_step={per_step} staleness={staleness}"
        case DispatchSpec(target, policy, affinity, instances):
            return f"{policy} -> {target} x{instances} group_affinity={format_value(affinity)}"
        case WeightSyncSpec(mode, staleness, interrupt):
            return f"{mode} staleness={staleness}" + (" interrupt" if interrupt else "")
        case WeightTransfer(nbytes, src, dst, reshard, route):
            return f"{route} {nbytes} bytes, {src} -> {dst}" + (" reshard" if reshard else "")
        case LayoutChoice(chosen, tps, efficiency, written, runners_up, why):
            rest = "".join(f"; runner-up {r}" for r in runners_up)
            return (f"auto {chosen} predicted {tps:.1f} tokens/s/device (bubble-free {efficiency:.0%}), written "
                    f"{written:.1f}; {why}{rest}")
    raise TypeError(f"not a pass result: {record!r}")
