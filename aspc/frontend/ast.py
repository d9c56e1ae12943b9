"""The located AST of an .aspl file: frozen dataclasses, each with a Span.

Spans and comments do not take part in equality, so `parse(format(ast)) == ast` holds for the round trip.
Nodes have __slots__: a 2 MB file makes hundreds of thousands of them, and per-node dicts made
memory and Python's cycle collector a fifth of the time of checking it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from aspc.ir.span import Span


def _span() -> Span:
    return field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Int:
    value: int
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Float:
    value: float
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Size:
    """A token count written with a binary suffix: 2k = 2048, 1M = 1048576."""

    text: str
    span: Span = _span()

    @property
    def value(self) -> int:
        scale = 1024 if self.text[-1] in "kK" else 1024 * 1024
        return round(float(self.text[:-1]) * scale)


@dataclass(frozen=True, slots=True)
class Str:
    value: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Bool:
    value: bool
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class List:
    items: tuple[Value, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Call:
    func: str
    args: tuple[Value, ...]
    kwargs: tuple[Option, ...]
    span: Span = _span()  # the function name
    extent: Span = _span()  # the whole call, `func(...)`


Value = Int | Float | Size | Str | Bool | Name | List | Call


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    value: Value
    span: Span = _span()  # the option's name

    @property
    def extent(self) -> Span | None:
        """The whole `name = value` text: where an error that this option causes points."""
        if self.span is None:
            return None
        return self.span.through(value_extent(self.value))


def value_extent(value: Value) -> Span | None:
    """The whole text of a value (a call with its arguments, a list with its brackets)."""
    return getattr(value, "extent", None) or value.span


@dataclass(frozen=True, slots=True)
class Pipeline:
    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    hardware: str
    count: Value
    span: Span = _span()
    hardware_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Model:
    """`model NAME = SOURCE[(args)] {options}`: a preset, `custom`, or `frozen(other)`."""

    name: str
    source: str
    args: tuple[Value, ...] | None  # None when written without parentheses
    options: tuple[Option, ...]
    span: Span = _span()
    source_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Data:
    """`data NAME = SOURCE(args) {options}`: `jsonl("file")` or `synthetic("task")`."""

    name: str
    source: str
    args: tuple[Value, ...] | None  # None when written without parentheses
    options: tuple[Option, ...]
    span: Span = _span()
    source_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Stage:
    """`stage NAME = KIND(inputs, key = value) [on POOL] {options}`."""

    name: str
    kind: str
    args: tuple[Value, ...]  # positional: names of models, data and stages
    options: tuple[Option, ...]  # keyword arguments and the options block, in order
    pool: Name | None
    span: Span = _span()
    kind_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Schedule:
    kind: str
    options: tuple[Option, ...]
    span: Span = _span()


Decl = Pipeline | Pool | Model | Data | Stage | Schedule


@dataclass(frozen=True, slots=True)
class Comment:
    """A `# ...` comment, kept for the formatter: above the declaration it precedes or sits inside,
    or at the end of that declaration's line (`trailing`). `anchor` is decl_key of that declaration;
    None: after the last one."""

    text: str  # from '#' to the end of the line, trailing blanks removed
    anchor: str | None
    trailing: bool = False
    span: Span = _span()


def decl_key(decl: Decl) -> str:
    """What a comment is anchored to: the kind and name of a declaration (the schedule has one)."""
    return f"{type(decl).__name__.lower()} {getattr(decl, 'name', '')}".rstrip()


@dataclass(frozen=True, slots=True)
class Program:
    file: str
    decls: tuple[Decl, ...]
    comments: tuple[Comment, ...] = field(default=(), compare=False, repr=False)  # not part of equality
