"""Pass pipeline strings: `async-decouple{staleness=1},queue-aware-dispatch,pack{tokens=16384}`."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from aspc.frontend.diagnostics import AsplError, Diagnostic, did_you_mean
from aspc.passes.base import Pass
from aspc.passes.registry import PASSES
from aspc.ir.span import Span

SOURCE = "<-p>"
_ITEM = re.compile(r"\s*([A-Za-z0-9_\-]+)\s*(?:\{([^{}]*)\})?\s*(,|$)")


@dataclass(frozen=True)
class PassSpec:
    """One pass of a pipeline string, with where it was written."""

    instance: Pass
    span: Span


def parse_pipeline(text: str, file: str = SOURCE, line: int = 1) -> list[PassSpec]:
    """The passes of a pipeline string, typed; every error as a diagnostic into `text`."""
    specs, errors, pos = [], [], 0
    while pos < len(text) and text[pos:].strip():
        match = _ITEM.match(text, pos)
        if match is None:
            raise AsplError([_error(file, line, pos, 1, "cannot read the pass pipeline here",
                                    "write passes as name or name{option=value,...}, separated by ','")])
        span = Span(file, line, match.start(1) + 1, line, match.end(1) + 1)
        try:
            specs.append(PassSpec(_instantiate(match.group(1), match.group(2) or "", span), span))
        except AsplError as error:
            errors += error.diagnostics
        pos = match.end()
    if errors:
        raise AsplError(errors)
    return specs


def _instantiate(name: str, body: str, span: Span) -> Pass:
    cls = PASSES.get(name)
    if cls is None:
        hint = did_you_mean(name, PASSES) or "passes: " + ", ".join(PASSES)
        raise AsplError([Diagnostic("error", span, f"unknown pass '{name}'", hint)])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, sep, raw = (x.strip() for x in item.partition("="))
        if not sep or key not in fields:
            hint = did_you_mean(key, fields) or ("options: " + ", ".join(fields) if fields else "it has no options")
            raise AsplError([Diagnostic("error", span, f"pass '{name}' has no option '{key}'", hint)])
        values[key] = _convert(name, key, raw, fields[key].type, span)
    return cls(**values)


def _convert(name: str, key: str, raw: str, kind, span: Span):
    kind = kind if isinstance(kind, str) else kind.__name__
    try:
        if kind == "int":
            return int(raw)
        if kind == "bool":
            if raw not in ("true", "false"):
                raise ValueError
            return raw == "true"
        return raw
    except ValueError:
        raise AsplError([Diagnostic("error", span, f"option {key} of pass '{name}' expects {kind}, "
                                                   f"got '{raw}'")]) from None


def _error(file: str, line: int, pos: int, width: int, message: str, hint: str) -> Diagnostic:
    return Diagnostic("error", Span(file, line, pos + 1, line, pos + 1 + width), message, hint)


def pipeline_text(passes: list[Pass]) -> str:
    return ",".join(p.spec() for p in passes)
