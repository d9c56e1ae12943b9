"""`--set key=value` overrides, applied to the AST before checking.

Keys: `STAGE.option`, `MODEL.option`, `DATA.option`, `schedule.option`, `POOL.count`, or a stage
kind (`generate.max_tokens`) for every stage of that kind. Values use the .aspl value syntax.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from aspc import ast, schema
from aspc.diagnostics import AsplError, DiagnosticSink, did_you_mean
from aspc.parser import parse_value
from aspc.span import Span

SOURCE = "<--set>"


def overrides_source(overrides: Iterable[str]) -> str:
    """The text diagnostics quote for overrides: one per line, as the user typed them."""
    return "\n".join(overrides)


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
    return ast.Program(program.file, tuple(decls))


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
