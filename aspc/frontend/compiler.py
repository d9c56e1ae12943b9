"""The front door: .aspl text -> checked StageGraph, or AsplError with every diagnostic."""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from pathlib import Path

from aspc.frontend import ast
from aspc.frontend.dataflow import check_cycles, check_dataflow
from aspc.frontend.diagnostics import AsplError, Diagnostic, DiagnosticSink, sorted_diagnostics
from aspc.ir.graph import StageGraph
from aspc.frontend.overrides import SOURCE as OVERRIDES_SOURCE
from aspc.frontend.overrides import apply_overrides, note_overridden_values, overrides_source
from aspc.frontend.parser import BOM, parse
from aspc.frontend.resolve import collect_symbols, resolve_data, resolve_models, resolve_pool, resolve_schedule
from aspc.frontend.resources import check_resources
from aspc.ir.span import Span
from aspc.frontend.stages import Resolved, resolve_stage
from aspc.ir.verify import verify
from aspc.memory import no_cycle_collection

MAX_FILE_BYTES = 16 * 1024 * 1024


@dataclass
class Compilation:
    """What one compile produced: the program, the graph, warnings, and the texts they quote."""

    program: ast.Program
    graph: StageGraph
    warnings: list[Diagnostic] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)


def read_source(path: str | Path) -> str:
    """The file's text, without a leading UTF-8 byte order mark; a directory and unreadable, huge
    or non-UTF-8 files become diagnostics."""
    name = str(path)
    if Path(path).is_dir():
        raise AsplError([Diagnostic("error", Span.point(name), "this is a directory, not an .aspl file",
                                    _directory_hint(Path(path)))])
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise AsplError([Diagnostic("error", Span.point(name), f"cannot read file: {error.strerror}")]) from None
    if len(data) > MAX_FILE_BYTES:
        raise AsplError([Diagnostic("error", Span.point(name), "file is larger than 16 MiB")])
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise AsplError([Diagnostic("error", Span.point(name, line, column),
                                    f"file is not valid UTF-8 (byte 0x{data[error.start]:02x})",
                                    "save the file as UTF-8")]) from None


def _directory_hint(folder: Path) -> str:
    inside = sorted(folder.glob("*.aspl"))
    return f"name an .aspl file, e.g. {inside[0]}" if inside else "name an .aspl file"


def compile_file(path: str | Path, overrides: list[str] | None = None) -> Compilation:
    return compile_source(read_source(path), str(path), overrides, Path(path).parent)


def compile_source(text: str, file: str = "<input>", overrides: list[str] | None = None,
                   base_dir: Path | None = None) -> Compilation:
    """Parse, apply overrides, check and lower; raises AsplError listing all errors."""
    with no_cycle_collection():
        return _compile(text, file, list(overrides or []), base_dir)


def _compile(text: str, file: str, overrides: list[str], base_dir: Path | None) -> Compilation:
    text = text.removeprefix(BOM)
    sink = DiagnosticSink()
    written = parse(text, file)
    program = apply_overrides(written, overrides, sink)
    graph = lower(program, base_dir, sink)
    sources = {file: text, OVERRIDES_SOURCE: overrides_source(overrides)}
    if overrides:
        sink.items = note_overridden_values(sink.items, written, overrides)
    sink.raise_if_errors()
    verify(graph)
    return Compilation(program, graph, sorted_diagnostics(sink.warnings), sources)


def lower(program: ast.Program, base_dir: Path | None, sink: DiagnosticSink) -> StageGraph:
    """Resolve declarations and build the stage graph; checks report into the sink."""
    symbols = collect_symbols(program, sink)
    pools = [p for p in map(lambda d: resolve_pool(d, sink), symbols.of(ast.Pool)) if p]
    models = resolve_models(symbols, sink, base_dir)
    data = [d for d in (resolve_data(d, base_dir, sink) for d in symbols.of(ast.Data)) if d]
    schedule = resolve_schedule(symbols.schedule, program.file, sink)
    name = symbols.pipeline.name if symbols.pipeline else "unnamed"
    env = Resolved(symbols, {p.name: p for p in pools}, models, {d.name: d for d in data}, base_dir)
    stages, flows = [], []
    for decl in symbols.of(ast.Stage):
        stage, stage_flows = resolve_stage(decl, env, sink)
        if stage is not None:
            stages.append(stage)
            flows += stage_flows
    names = {s.name for s in stages}
    flows = [f for f in flows if f.src in names and f.dst in names]
    graph = StageGraph(name, pools, models.values(), data, schedule, stages, flows)
    if sink.errors:  # later checks assume every stage resolved
        return graph
    if check_cycles(graph, sink):
        check_dataflow(graph, sink)
        check_resources(graph, sink)
    return graph
