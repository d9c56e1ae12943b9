"""Plain values the IR holds for options: int, float, str, bool, tuples and Call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """A checked call value such as `rule(name="exact_match", weight=1.0)`; kwargs sorted by name."""

    func: str
    kwargs: tuple[tuple[str, Any], ...]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.kwargs).get(name, default)

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={format_value(v)}" for k, v in self.kwargs)
        return f"{self.func}({inner})"


def format_value(value: Any) -> str:
    """The canonical text of a value, shared by the IR printer and the formatter."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)
