"""Typed reading of option lists against the schema: unknown, duplicate, type and range errors."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from aspc.frontend import ast
from aspc.frontend.diagnostics import DiagnosticSink, did_you_mean
from aspc.frontend.schema import CALLS, LENGTH_CALLS, OMITTED_UNSET, REQUIRED, OptionSpec
from aspc.ir.span import Span
from aspc.ir.values import Call

INVALID = object()  # a value that failed its check (already reported)

_TYPE_WORDS = {
    "int": "an integer", "float": "a number", "floats": "a list of numbers", "bool": "true or false",
    "str": 'a string "..."', "enum": "one of", "ref": "a name", "call": "a call such as",
    "calls": "a list of calls such as",
}


@dataclass
class OptionValues:
    """Checked values (defaults filled in) and where each explicit one was written."""

    values: dict[str, Any] = field(default_factory=dict)
    spans: dict[str, Span] = field(default_factory=dict)  # option name spans, explicit ones only
    value_spans: dict[str, Span] = field(default_factory=dict)
    extents: dict[str, Span] = field(default_factory=dict)  # the whole `name = value` text

    @property
    def option_spans(self) -> tuple[tuple[str, Span], ...]:
        """Where each explicit option was written, as the IR keeps it for later checks."""
        return tuple(self.extents.items())

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def given(self, name: str) -> bool:
        return name in self.spans

    def valid(self, *names: str) -> bool:
        return all(self.values.get(n) is not INVALID for n in names)


def read_options(options: tuple[ast.Option, ...], specs: dict[str, OptionSpec], owner: str,
                 owner_span: Span, sink: DiagnosticSink) -> OptionValues:
    """Check every option of a declaration; missing ones get their defaults."""
    result = OptionValues()
    for option in options:
        if option.name in result.spans:
            sink.error(option.span, f"option '{option.name}' is given twice",
                       notes=[(result.spans[option.name], "first given here")])
            continue
        spec = specs.get(option.name)
        if spec is None:
            _unknown_option(option, specs, owner, sink)
            continue
        result.spans[option.name] = option.span
        result.value_spans[option.name] = value_span(option.value)
        result.extents[option.name] = option.extent
        result.values[option.name] = convert(option.value, spec, sink)
    for name, spec in specs.items():
        if name in result.spans:
            continue
        if spec.default is REQUIRED:
            sink.error(owner_span, f"{owner} needs option '{name}' ({spec.doc})")
            result.values[name] = INVALID
        else:
            result.values[name] = spec.default
    return result


def _unknown_option(option: ast.Option, specs: dict[str, OptionSpec], owner: str,
                    sink: DiagnosticSink) -> None:
    if not specs:
        sink.error(option.span, f"{owner} takes no options, but '{option.name}' is given")
        return
    hint = did_you_mean(option.name, specs) or "it takes: " + ", ".join(sorted(specs))
    sink.error(option.span, f"unknown option '{option.name}' for {owner}", hint)


def convert(value: ast.Value, spec: OptionSpec, sink: DiagnosticSink) -> Any:
    """One value checked against its spec; reports and returns INVALID when it does not fit."""
    checked = _CONVERTERS[spec.type](value, spec, sink)
    if checked is INVALID or checked is _WRONG_TYPE:
        if checked is _WRONG_TYPE:
            sink.error(value_span(value), f"option '{spec.name}' expects {_expected(spec)}, "
                                          f"got {describe(value)}")
        return INVALID
    return _check_range(checked, value, spec, sink)


_WRONG_TYPE = object()


def _to_int(value, spec, sink):
    if isinstance(value, (ast.Int, ast.Size)):
        return value.value
    return _WRONG_TYPE


def _to_float(value, spec, sink):
    if not isinstance(value, (ast.Int, ast.Float, ast.Size)):
        return _WRONG_TYPE
    number = float(value.value)
    if not math.isfinite(number):
        sink.error(value_span(value), f"option '{spec.name}' is too large a number")
        return INVALID
    return number


def _to_floats(value, spec, sink):
    """A list of numbers, each checked against the spec's range where it is written."""
    if not isinstance(value, ast.List) or not value.items:
        return _WRONG_TYPE
    numbers = []
    for item in value.items:
        number = _to_float(item, spec, sink)
        if number is _WRONG_TYPE:
            sink.error(value_span(item), f"option '{spec.name}' is a list of numbers, got {describe(item)}")
            return INVALID
        numbers.append(number if number is INVALID else _check_range(number, item, spec, sink))
    return INVALID if INVALID in numbers else tuple(numbers)


def _to_bool(value, spec, sink):
    return value.value if isinstance(value, ast.Bool) else _WRONG_TYPE


def _to_str(value, spec, sink):
    return value.value if isinstance(value, ast.Str) else _WRONG_TYPE


def _to_ref(value, spec, sink):
    return value.name if isinstance(value, ast.Name) else _WRONG_TYPE


def _to_enum(value, spec, sink):
    if not isinstance(value, (ast.Name, ast.Str)):
        return _WRONG_TYPE
    word = value.name if isinstance(value, ast.Name) else value.value
    if word in spec.choices:
        return word
    hint = did_you_mean(word, spec.choices) or "choose one of: " + ", ".join(spec.choices)
    sink.error(value_span(value), f"'{word}' is not a valid {spec.name}", hint)
    return INVALID


def _to_call(value, spec, sink):
    if not isinstance(value, ast.Call):
        return _WRONG_TYPE
    if value.func not in spec.choices:
        hint = did_you_mean(value.func, spec.choices) or "choose one of: " + ", ".join(spec.choices)
        sink.error(value.span, f"'{value.func}(...)' is not allowed in '{spec.name}'", hint)
        return INVALID
    return read_call(value, sink)


def _to_calls(value, spec, sink):
    items = value.items if isinstance(value, ast.List) else (value,)
    if not items or not all(isinstance(i, ast.Call) for i in items):
        return _WRONG_TYPE
    converted = tuple(_to_call(i, spec, sink) for i in items)
    return INVALID if INVALID in converted else converted


_CONVERTERS = {"int": _to_int, "float": _to_float, "floats": _to_floats, "bool": _to_bool, "str": _to_str,
               "ref": _to_ref, "enum": _to_enum, "call": _to_call, "calls": _to_calls}


def read_call(call: ast.Call, sink: DiagnosticSink) -> Any:
    """A call value: positional arguments bound to the parameters in order, kwargs by name."""
    if call.func == "mixture":
        return _read_mixture(call, sink)
    spec = CALLS[call.func]
    params = {p.name: p for p in spec.params}
    if len(call.args) > len(spec.params):
        sink.error(value_span(call.args[len(spec.params)]),
                   f"{call.func}(...) takes at most {len(spec.params)} arguments: "
                   + ", ".join(params))
        return INVALID
    bound = tuple(ast.Option(p.name, v, value_span(v)) for p, v in zip(spec.params, call.args))
    checked = read_options(bound + call.kwargs, params, f"{call.func}(...)", call.span, sink)
    if not checked.valid(*params):
        return INVALID
    values = {k: v for k, v in checked.values.items() if not (k in OMITTED_UNSET and v is None)}
    return Call(call.func, tuple(sorted(values.items())))


_MIXTURE_EXAMPLE = "e.g. mixture(lognormal(mean = 1k), fixed(length = 8k), weights = [0.7, 0.3])"


def _read_mixture(call: ast.Call, sink: DiagnosticSink) -> Any:
    """`mixture(DIST, DIST, ..., weights = [...], per = "sample")`: the components are the positional
    arguments; weights default to equal. The value keeps them as `components`."""
    params = {p.name: p for p in CALLS["mixture"].params}
    checked = read_options(call.kwargs, params, "mixture(...)", call.span, sink)
    components = tuple(_mixture_component(arg, sink) for arg in call.args)
    if not components:
        sink.error(call.span, "mixture(...) needs at least one length distribution", _MIXTURE_EXAMPLE)
        return INVALID
    if INVALID in components or not checked.valid(*params):
        return INVALID
    weights = checked["weights"] or (1.0,) * len(components)
    if len(weights) != len(components):
        sink.error(checked.value_spans["weights"], f"mixture(...) has {len(components)} components but "
                   f"{len(weights)} weights", "give one weight per component, in the same order")
        return INVALID
    return Call("mixture", (("components", components), ("per", checked["per"]), ("weights", weights)))


def _mixture_component(arg: ast.Value, sink: DiagnosticSink) -> Any:
    if isinstance(arg, ast.Call) and arg.func == "mixture":
        sink.error(arg.span, "a mixture inside a mixture is not supported",
                   "list its components in the outer mixture, their weights multiplied by its weight")
        return INVALID
    if isinstance(arg, ast.Call) and arg.func in LENGTH_CALLS:
        return read_call(arg, sink)
    sink.error(value_span(arg), "a mixture component is a length distribution (" + ", ".join(LENGTH_CALLS)
               + f"), not {describe(arg)}", _MIXTURE_EXAMPLE)
    return INVALID


def _check_range(checked: Any, value: ast.Value, spec: OptionSpec, sink: DiagnosticSink) -> Any:
    if not isinstance(checked, (int, float)) or isinstance(checked, bool):
        return checked
    low_ok = spec.lo is None or (checked > spec.lo if spec.lo_open else checked >= spec.lo)
    high_ok = spec.hi is None or checked <= spec.hi
    if low_ok and high_ok:
        return checked
    sink.error(value_span(value), f"option '{spec.name}' must be {_range_text(spec)}, "
                                  f"got {_number(checked)}")
    return INVALID


def _range_text(spec: OptionSpec) -> str:
    low = None if spec.lo is None else f"{'>' if spec.lo_open else '>='} {_number(spec.lo)}"
    high = None if spec.hi is None else f"<= {_number(spec.hi)}"
    return " and ".join(x for x in (low, high) if x)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _expected(spec: OptionSpec) -> str:
    words = _TYPE_WORDS[spec.type]
    if spec.type == "enum":
        return f"{words} {', '.join(spec.choices)}"
    if spec.type in ("call", "calls"):
        return f"{words} {spec.choices[0]}(...)"
    return words


def describe(value: ast.Value) -> str:
    """A user-facing description of a written value, for type errors."""
    if isinstance(value, ast.Int):
        return f"integer {value.value}"
    if isinstance(value, ast.Float):
        return f"number {value.value}"
    if isinstance(value, ast.Size):
        return f"size {value.text}"
    if isinstance(value, ast.Str):
        return f'string "{value.value}"'
    if isinstance(value, ast.Bool):
        return "true" if value.value else "false"
    if isinstance(value, ast.Name):
        return f"name '{value.name}'"
    if isinstance(value, ast.List):
        return "a list"
    return f"call {value.func}(...)"


def value_span(value: ast.Value) -> Span:
    return value.span
