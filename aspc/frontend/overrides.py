"""`--set key=value` overrides, applied to the AST before checking.

Keys: `STAGE.option`, `MODEL.option`, `DATA.option`, `schedule.option`, `POOL.count`, or a stage
kind (`generate.max_tokens`) for every stage of that kind. Values use the .aspl value syntax.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from aspc.frontend import ast, schema
from aspc.frontend.diagnostics import AsplError, Diagnostic, DiagnosticSink, did_you_mean
from aspc.frontend.parser import parse_value
from aspc.ir.span import Span

SOURCE = "<--set>"


def overrides_source(overrides: Iterable[str]) -> str:
    """The text diagnostics quote for overrides: one per line, as the user typed them."""
    return "\n".join(overrides)


def override_span(spec, names: Iterable[str]) -> Span | None:
    """Where the first of these options was given with --set, if one was: an error that several
    options cause together points at the one the user changed on the command line."""
    spans = (spec.option_span(name) for name in names)
    return next((span for span in spans if span is not None and span.file == SOURCE), None)


def note_overridden_values(diagnostics: list[Diagnostic], program: ast.Program,
                           overrides: list[str]) -> list[Diagnostic]:
    """Diagnostics that point at a --set also show the value in the file that it replaced."""
    replaced = _replaced_values(program, overrides)
    return [_with_replaced_note(d, replaced) for d in diagnostics]


def _with_replaced_note(diagnostic: Diagnostic, replaced: dict[int, tuple[Span, ...]]) -> Diagnostic:
    notes = replaced.get(diagnostic.span.line, ()) if diagnostic.span.file == SOURCE else ()
    return dataclasses.replace(diagnostic, notes=diagnostic.notes + notes) if notes else diagnostic


def _replaced_values(program: ast.Program, overrides: list[str]) -> dict[int, tuple]:
    """For each override (by its line in <--set>), notes at the values in the file it replaces."""
    decls = list(program.decls)
    replaced = {}
    for line, text in enumerate(overrides, start=1):
        target, _, option = text.partition("=")[0].strip().partition(".")
        spans = [span for i in _targets(decls, target) for span in _written(decls[i], option)]
        if spans:
            replaced[line] = tuple((span, f"--set {text} replaces the value written here") for span in spans)
    return replaced


def _written(decl: ast.Decl, option: str) -> list[Span]:
    if isinstance(decl, ast.Pool):
        return [ast.value_extent(decl.count)] if option == "count" and decl.count.span else []
    return [o.extent for o in getattr(decl, "options", ()) if o.name == option and o.extent]


def apply_overrides(program: ast.Program, overrides: list[str], sink: DiagnosticSink) -> ast.Program:
    decls = list(program.decls)
    for line, text in enumerate(overrides, start=1):
        key, sep, value_text = text.partition("=")
        key_span = Span(SOURCE, line, 1, line, max(2, len(key) + 1))
        target, _, option = key.strip().partition(".")
        if not sep or not target or not option or "." in option:
            sink.error(key_span, f"cannot read override '{text}'", "write --set NAME.option=value")
            continue
        try:
            value = parse_value("\n" * (line - 1) + " " * (len(key) + 1) + value_text, SOURCE)
        except AsplError as error:
            sink.items.extend(error.diagnostics)
            continue
        if target == "schedule" and not any(isinstance(d, ast.Schedule) for d in decls):
            decls.append(ast.Schedule("asp", (), key_span))
        new_option = ast.Option(option, value, Span(SOURCE, line, len(target) + 2, line, len(key) + 1))
        indices = _targets(decls, target)
        if not indices:
            sink.error(key_span, f"--set names '{target}', which is not declared",
                       did_you_mean(target, _names(decls)))
        for i in indices:
            decls[i] = _set(decls[i], new_option, value, sink)
    return dataclasses.replace(program, decls=tuple(decls))  # its comments stay


def _targets(decls: list[ast.Decl], target: str) -> list[int]:
    named = [i for i, d in enumerate(decls) if getattr(d, "name", None) == target
             and not isinstance(d, ast.Pipeline)]
    if named:
        return named
    if target == "schedule":
        return [i for i, d in enumerate(decls) if isinstance(d, ast.Schedule)]
    if target in schema.STAGES:
        return [i for i, d in enumerate(decls) if isinstance(d, ast.Stage) and d.kind == target]
    return []


def _names(decls: list[ast.Decl]) -> list[str]:
    names = [d.name for d in decls if hasattr(d, "name") and not isinstance(d, ast.Pipeline)]
    return names + ["schedule"] + list(schema.STAGES)


def _set(decl: ast.Decl, option: ast.Option, value: ast.Value, sink: DiagnosticSink) -> ast.Decl:
    if isinstance(decl, ast.Pool):
        if option.name == "count":
            return dataclasses.replace(decl, count=value)
        sink.error(option.span, f"a pool has only a count to override, not '{option.name}'")
        return decl
    if isinstance(decl, ast.Pipeline):
        sink.error(option.span, "the pipeline name has no options")
        return decl
    kept = tuple(o for o in decl.options if o.name != option.name)
    return dataclasses.replace(decl, options=kept + (option,))
