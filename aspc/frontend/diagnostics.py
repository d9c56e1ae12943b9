"""Diagnostics: `file:line:col: error: message`, the source line, a caret and a hint."""
from __future__ import annotations

import difflib
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator

from aspc.ir.span import Span


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


class Suggestions:
    """did_you_mean over one set of names, asked many times (every unknown name of a file).

    Comparing a word with every name makes a file with thousands of typos quadratic. A large set is
    indexed once by its one-deletion variants instead: names one edit or one swap apart share a
    variant, and only those are compared. Small sets are searched whole, as did_you_mean does."""

    SMALL = 200

    def __init__(self, names: Iterable[str]):
        self.names = sorted(set(names))
        self._by_variant: dict[str, list[str]] | None = None

    def hint(self, word: str) -> str:
        if len(self.names) <= self.SMALL:
            return did_you_mean(word, self.names)
        return did_you_mean(word, {n for v in _variants(word) for n in self._index().get(v, ())})

    def _index(self) -> dict[str, list[str]]:
        if self._by_variant is None:
            self._by_variant = {}
            for name in self.names:
                for variant in _variants(name):
                    self._by_variant.setdefault(variant, []).append(name)
        return self._by_variant


def _variants(word: str) -> set[str]:
    return {word} | {word[:i] + word[i + 1:] for i in range(len(word))}


WARNING_CAP = 10  # diagnostics of one kind shown before the rest are summed up in one line
ERROR_CAP = WARNING_CAP  # thousands of one error say no more than ten of them (the count stays exact)


def render(diagnostic: Diagnostic, sources: dict[str, str] | SourceLines) -> str:
    """The text a user sees for one diagnostic (no colour, stable for golden files)."""
    lines = SourceLines.of(sources)
    out = [f"{diagnostic.span}: {diagnostic.severity}: {diagnostic.message}"]
    out += _excerpt(diagnostic.span, lines)
    for span, note in diagnostic.notes:
        out.append(f"{span}: note: {note}")
        out += _excerpt(span, lines)
    if diagnostic.hint:
        out.append(f"  hint: {diagnostic.hint}")
    return "\n".join(out)


def render_all(diagnostics: Iterable[Diagnostic], sources: dict[str, str],
               warning_cap: int = WARNING_CAP, error_cap: int = ERROR_CAP) -> str:
    """The first `error_cap` errors and `warning_cap` warnings of each kind, each capped kind with a
    line counting the rest, and the number of all errors. Each source is split into lines once, so
    the cost is linear in the sources and diagnostics."""
    items = list(diagnostics)
    lines = SourceLines.of(sources)
    caps = {"error": error_cap, "warning": warning_cap}
    blocks = []
    for diagnostic, omitted in _capped(items, caps):
        blocks.append(render(diagnostic, lines))
        if omitted:
            blocks.append(_omitted_line(diagnostic.severity, omitted, caps[diagnostic.severity]))
    text = "\n".join(blocks)
    errors = sum(d.severity == "error" for d in items)
    if errors:
        text += f"\n{errors} error{'s' if errors != 1 else ''} generated."
    return text


def _omitted_line(severity: str, omitted: int, cap: int) -> str:
    plural = "s" if omitted != 1 else ""
    if severity == "error":
        return f"... and {omitted} more error{plural} of this kind (the first {cap} of each kind are shown)"
    return f"... and {omitted} more warning{plural} like this (the first {cap} of each kind are shown)"


def _capped(items: list[Diagnostic], caps: dict[str, int]) -> Iterator[tuple[Diagnostic, int]]:
    """The diagnostics to show, each with the number of its kind left out after it (0 mostly).
    A kind is a severity and a message with its particulars blanked."""
    totals = Counter((d.severity, _kind(d)) for d in items)
    shown: Counter = Counter()
    for diagnostic in items:
        kind = (diagnostic.severity, _kind(diagnostic))
        cap = caps[diagnostic.severity]
        shown[kind] += 1
        if shown[kind] <= cap:
            yield diagnostic, totals[kind] - cap if shown[kind] == cap else 0


_PARTICULARS = re.compile(r"'[^']*'|\"[^\"]*\"|-?\d+(?:\.\d+)?")


def _kind(diagnostic: Diagnostic) -> str:
    """A message with its names, strings and numbers blanked: diagnostics of one kind share it."""
    return _PARTICULARS.sub("_", diagnostic.message)


class SourceLines:
    """The lines of each source, split once and on "\\n" only (as the parser counts lines)."""

    def __init__(self, sources: dict[str, str]):
        self.sources = sources
        self._lines: dict[str, list[str]] = {}

    @staticmethod
    def of(sources: dict[str, str] | SourceLines) -> SourceLines:
        return sources if isinstance(sources, SourceLines) else SourceLines(sources)

    def line(self, file: str, number: int) -> str | None:
        lines = self._lines.get(file)
        if lines is None:
            text = self.sources.get(file)
            if text is None:
                return None
            lines = self._lines[file] = _split_lines(text)
        if not 1 <= number <= len(lines):
            return None
        return lines[number - 1].removesuffix("\r")


def _split_lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines[-1] == "":  # a final newline ends the last line; it does not start another
        lines.pop()
    return lines


def _excerpt(span: Span, sources: SourceLines) -> list[str]:
    text = sources.line(span.file, span.line)
    if text is None:
        return []
    line = text.expandtabs(1)
    if len(line) > 200:  # very long lines: show the neighbourhood of the caret only
        start = max(0, span.column - 80)
        line, column = line[start:start + 160], span.column - start
    else:
        column = span.column
    width = span.end_column - span.column if span.end_line == span.line else len(line) - column + 1
    width = max(1, min(width, len(line) - column + 1))
    gutter = f"{span.line:>5} | "
    before, marked = line[:column - 1], line[column - 1:column - 1 + width]
    caret = " " * _cells(before) + "^" * max(1, _cells(marked))
    return [gutter + line, " " * (len(gutter) - 2) + "| " + caret]


def _cells(text: str) -> int:
    """Terminal columns of a text: East Asian wide characters take two, so carets line up."""
    if text.isascii():
        return len(text)
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)
