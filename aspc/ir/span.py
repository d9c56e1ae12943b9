"""Source locations: every AST node and every diagnostic points at the user's text."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True, slots=True)
class Span:
    """A region of one source file; lines and columns count from 1, end_column is exclusive.
    Slotted, as every AST node carries one or two."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def point(file: str, line: int = 1, column: int = 1) -> Span:
        return Span(file, line, column, line, column + 1)

    def through(self, other: Span | None) -> Span:
        """From the start of this span to the end of another in the same file (this one alone
        when the other is missing or elsewhere)."""
        if other is None or other.file != self.file:
            return self
        return Span(self.file, self.line, self.column, other.end_line, other.end_column)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"
