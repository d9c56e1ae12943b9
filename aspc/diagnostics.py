"""Diagnostics: `file:line:col: error: message`, the source line, a caret and a hint."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable

from aspc.span import Span


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    span: Span
    message: str
    hint: str = ""
    notes: tuple[tuple[Span, str], ...] = ()


class AsplError(Exception):
    """Raised with every error of a compilation; the CLI renders it, never a traceback."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = tuple(diagnostics)
        super().__init__("; ".join(f"{d.span}: {d.message}" for d in self.diagnostics))


@dataclass
class DiagnosticSink:
    """Collects diagnostics so that a check reports all errors of a file at once."""

    items: list[Diagnostic] = field(default_factory=list)

    def error(self, span: Span, message: str, hint: str = "", notes=()) -> None:
        self.items.append(Diagnostic("error", span, message, hint, tuple(notes)))

    def warning(self, span: Span, message: str, hint: str = "") -> None:
        self.items.append(Diagnostic("warning", span, message, hint))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "warning"]

    def raise_if_errors(self) -> None:
        if self.errors:
            raise AsplError(sorted_diagnostics(self.items))


def sorted_diagnostics(items: Iterable[Diagnostic]) -> list[Diagnostic]:
    return sorted(items, key=lambda d: (d.span.file, d.span.line, d.span.column, d.message))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """A hint naming the closest candidate, or '' when nothing is close."""
    close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def render(diagnostic: Diagnostic, sources: dict[str, str]) -> str:
    """The text a user sees for one diagnostic (no colour, stable for golden files)."""
    lines = [f"{diagnostic.span}: {diagnostic.severity}: {diagnostic.message}"]
    lines += _excerpt(diagnostic.span, sources)
    for span, note in diagnostic.notes:
        lines.append(f"{span}: note: {note}")
        lines += _excerpt(span, sources)
    if diagnostic.hint:
        lines.append(f"  hint: {diagnostic.hint}")
    return "\n".join(lines)


def render_all(diagnostics: Iterable[Diagnostic], sources: dict[str, str]) -> str:
    items = list(diagnostics)
    text = "\n".join(render(d, sources) for d in items)
    errors = sum(d.severity == "error" for d in items)
    if errors:
        text += f"\n{errors} error{'s' if errors != 1 else ''} generated."
    return text


def _excerpt(span: Span, sources: dict[str, str]) -> list[str]:
    text = sources.get(span.file)
    if text is None:
        return []
    source_lines = text.splitlines()
    if not 1 <= span.line <= len(source_lines):
        return []
    line = source_lines[span.line - 1].expandtabs(1)
    if len(line) > 200:  # very long lines: show the neighbourhood of the caret only
        start = max(0, span.column - 80)
        line, column = line[start:start + 160], span.column - start
    else:
        column = span.column
    width = span.end_column - span.column if span.end_line == span.line else len(line) - column + 1
    width = max(1, min(width, len(line) - column + 1))
    gutter = f"{span.line:>5} | "
    return [gutter + line, " " * (len(gutter) - 2) + "| " + " " * (column - 1) + "^" * width]
