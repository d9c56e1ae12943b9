"""JSON form of the stage graph (`--emit json`), and the reader that makes the round trip.

A stage's pass results are an object `results`: field name -> the record's fields (only the
results the stage has)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from aspc.ir.facts import Hardware, ModelArch
from aspc.ir.graph import (RESULTS, DataSpec, Flow, ModelSpec, Parallel, PoolSpec, ScheduleSpec, Stage, StageGraph,
                           StageKind)
from aspc.ir.span import Span
from aspc.ir.values import Call

FORMAT_VERSION = 2  # 2: pass results as typed records (`results`), not options


def to_json(graph: StageGraph) -> str:
    return json.dumps(to_dict(graph), indent=2, sort_keys=True) + "\n"


def to_dict(graph: StageGraph) -> dict[str, Any]:
    return {
        "format": "aspc.stage_graph", "version": FORMAT_VERSION, "pipeline": graph.pipeline,
        "schedule": {"kind": graph.schedule.kind, "options": _options(graph.schedule.options),
                     "span": _span(graph.schedule.span)},
        "pools": [_record(p, hardware=dataclasses.asdict(p.hardware)) for _, p in sorted(graph.pools.items())],
        "models": [_record(m, arch=_arch(m.arch)) for _, m in sorted(graph.models.items())],
        "data": [_record(d, response_lengths=encode(d.response_lengths),
                         prompt_lengths=encode(d.prompt_lengths)) for _, d in sorted(graph.data.items())],
        "stages": [_stage(s) for s in graph.stages()],
        "flows": [{"src": f.src, "dst": f.dst, "fields": list(f.fields)} for f in graph.flows()],
    }


def _stage(stage: Stage) -> dict[str, Any]:
    out = _record(stage, kind=stage.kind.name, parallel=dataclasses.asdict(stage.parallel),
                  options=_options(stage.options))
    for name in RESULTS:
        del out[name]
    out["results"] = {name: encode(dataclasses.asdict(record)) for name, record in stage.results()}
    return out


def _arch(arch: ModelArch) -> dict[str, Any]:
    """The shape's fields; those marked omit_if_default (a checkpoint's extras) only when set."""
    return {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)
            if not (f.metadata.get("omit_if_default") and getattr(arch, f.name) == f.default)}


def _record(obj, **overrides) -> dict[str, Any]:
    """The compared fields of an IR record (where options were written is for diagnostics only)."""
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare}
    out.update(overrides)
    out["span"] = _span(obj.span)
    return out


def _options(pairs) -> dict[str, Any]:
    return {k: encode(v) for k, v in pairs}


def _span(span: Span | None) -> str | None:
    return None if span is None else f"{span.file}:{span.line}:{span.column}"


def encode(value: Any) -> Any:
    if isinstance(value, Call):
        return {"call": value.func, "kwargs": {k: encode(v) for k, v in value.kwargs}}
    if isinstance(value, tuple):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        return Call(value["call"], tuple(sorted((k, decode(v)) for k, v in value["kwargs"].items())))
    if isinstance(value, list):
        return tuple(decode(v) for v in value)
    return value


def from_json(text: str) -> StageGraph:
    return from_dict(json.loads(text))


def from_dict(doc: dict[str, Any]) -> StageGraph:
    if doc.get("format") != "aspc.stage_graph" or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"not an aspc stage graph of format version {FORMAT_VERSION}")
    pools = [PoolSpec(p["name"], Hardware(**p["hardware"]), p["count"], _unspan(p["span"]))
             for p in doc["pools"]]
    models = [ModelSpec(**{**m, "arch": ModelArch(**m["arch"]), "span": _unspan(m["span"])})
              for m in doc["models"]]
    data = [DataSpec(**{**d, "response_lengths": decode(d["response_lengths"]),
                        "prompt_lengths": decode(d["prompt_lengths"]), "span": _unspan(d["span"])})
            for d in doc["data"]]
    sched = doc["schedule"]
    schedule = ScheduleSpec(sched["kind"], _pairs(sched["options"]), _unspan(sched["span"]))
    stages = [Stage(**{**{k: v for k, v in s.items() if k != "results"}, "kind": StageKind[s["kind"]],
                       "parallel": Parallel(**s["parallel"]), "options": _pairs(s["options"]),
                       "span": _unspan(s["span"]), **_results(s["results"])})
              for s in doc["stages"]]
    flows = [Flow(f["src"], f["dst"], tuple(f["fields"])) for f in doc["flows"]]
    return StageGraph(doc["pipeline"], pools, models, data, schedule, stages, flows)


def _results(results: dict[str, Any]) -> dict[str, Any]:
    """Pass-result records from their JSON objects (lists back to tuples)."""
    return {name: RESULTS[name](**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
            for name, fields in results.items()}


def _pairs(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, decode(v)) for k, v in options.items()))


def _unspan(text: str | None) -> Span | None:
    if text is None:
        return None
    file, line, column = text.rsplit(":", 2)
    return Span.point(file, int(line), int(column))
