"""The passes' decisions, phrased for a reader and placed at the source line they concern: a
decision about a stage at the stage's declaration (a stage a pass inserted, `gen.channel`, at the
stage it serves), and each pass at the schedule option that asked for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aspc.ir.graph import (Batching, ChannelSpec, DispatchSpec, MicroBatchShape, PartialRollout, Placement,
                           Stage, StageGraph, Streaming, WeightSyncSpec, WeightTransfer)
from aspc.report.model import PassChange

# The schedule option each pass comes from (a schedule block's `staleness = 1` runs async-decouple).
PASS_OPTION = {"async-decouple": "staleness", "queue-aware-dispatch": "dispatch", "pack": "pack",
               "stream": "stream", "partial-rollout": "partial_rollout"}


@dataclass(frozen=True)
class Decision:
    line: int  # 0: not at a line of the file (a schedule the file does not declare, a --set option)
    pass_spec: str
    subject: str  # the stage it concerns, or "schedule"
    text: str


def decisions(file: str, passes: list[PassChange]) -> list[Decision]:
    """Every pass's summary and every stage result it set or changed, in pipeline order."""
    out = []
    for change in passes:
        out.append(_pass_summary(file, change))
        out += [Decision(_stage_line(file, change.after, stage), change.spec, stage.name, text)
                for stage, text in _changes(change)]
    return out


def _pass_summary(file: str, change: PassChange) -> Decision:
    schedule = change.after.schedule
    span = schedule.option_span(PASS_OPTION.get(change.name, "")) or schedule.span
    plural = "s" if "," in change.bubble else ""
    removes = f"removes the {change.bubble} bubble{plural}" if change.bubble else "no bubble of its own"
    touched = sorted({stage.name for stage, _ in _changes(change)})
    text = f"pass {change.spec}: {removes}; decides for {', '.join(touched) or 'no stage'}"
    return Decision(_line(file, span), change.spec, "schedule", text)


def _changes(change: PassChange) -> list[tuple[Stage, str]]:
    out = []
    for stage in change.after.stages():
        old = change.before.stage(stage.name) if change.before.has_stage(stage.name) else None
        for name, record in stage.results():
            if old is None or getattr(old, name) != record:
                out.append((stage, phrase(record, stage)))
    return out


def _stage_line(file: str, graph: StageGraph, stage: Stage) -> int:
    if stage.span is None and "." in stage.name:  # inserted by a pass for the stage before the dot
        owner = stage.name.split(".")[0]
        if graph.has_stage(owner):
            return _line(file, graph.stage(owner).span)
    return _line(file, stage.span)


def _line(file: str, span) -> int:
    return span.line if span is not None and span.file == file else 0


def phrase(record: Any, stage: Stage) -> str:
    """One pass result in words, with the stage it is about."""
    return f"{stage.name}: {words(record, stage)}"


def words(record: Any, stage: Stage) -> str:
    """A pass result in words."""
    match record:
        case Placement(kind, offset):
            last = offset + stage.devices - 1
            where = "time-shares" if kind == "time_shared" else "has its own"
            return f"placed on pool {stage.pool}, devices {offset}-{last} ({where} devices)"
        case Batching(mode):
            return f"{mode} batching of decoding"
        case MicroBatchShape(tokens, buckets, balance, padding, fraction):
            shapes = f"padded to {len(buckets)} shape buckets ({buckets[0]}..{buckets[-1]})" \
                if padding == "buckets" and buckets else "dynamic shapes, no padding"
            expected = f", expected padding {100 * fraction:.2f}%" if fraction is not None else ""
            return f"micro-batches of at most {tokens} tokens, {balance} balanced over dp ranks, {shapes}{expected}"
        case Streaming(micro):
            return f"streams micro-batches of {micro} samples as they arrive (no gather barrier)"
        case PartialRollout(max_split):
            return f"partial rollout: a long generation may be paused and resumed at most {max_split}x at weight syncs"
        case ChannelSpec(capacity, per_step, staleness):
            return f"bounded channel of {capacity} samples ({per_step} per step), staleness <= {staleness}"
        case DispatchSpec(target, policy, affinity, instances):
            group = ", a prompt's group kept together" if affinity else ""
            return f"{policy} dispatch over {instances} instances of {target}{group}"
        case WeightSyncSpec(mode, staleness, interrupt):
            pause = ", pausing in-flight generations" if interrupt else ""
            return f"{mode} weight sync (staleness <= {staleness}){pause}"
        case WeightTransfer(nbytes, src, dst, reshard, route):
            how = "offload/onload" if route == "offload_onload" else "over the interconnect"
            return f"{nbytes / 1e9:.1f} GB of weights {src} -> {dst}{' resharded' if reshard else ''}, {how}"
    raise TypeError(f"not a pass result: {record!r}")
