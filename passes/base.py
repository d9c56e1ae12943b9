"""What a pass is: a frozen dataclass with a kebab-case name, typed option fields and `apply`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from aspc.ir.graph import StageGraph


class PassError(Exception):
    """A pass cannot run on this graph (a precondition does not hold, or an option is bad)."""


@dataclass(frozen=True)
class Pass:
    """Subclasses set `name`, declare options as fields with defaults, and implement `apply`.

    `apply` is pure: it returns a new StageGraph and never mutates its input.
    """

    name: ClassVar[str] = ""
    bubble: ClassVar[str] = ""  # which bubble it removes (docs, inspect)
    # passes that, when a pipeline has them, must run before this one: name -> why (checked by the
    # pass manager before anything runs)
    after: ClassVar[dict[str, str]] = {}

    def apply(self, graph: StageGraph) -> StageGraph:
        raise NotImplementedError

    def spec(self) -> str:
        """The pass as written in a pipeline string: name{opt=value,...} (defaults omitted)."""
        from dataclasses import fields

        changed = [f"{f.name}={_text(getattr(self, f.name))}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return self.name + ("{" + ",".join(changed) + "}" if changed else "")


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
