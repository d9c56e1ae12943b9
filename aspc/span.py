"""Source locations: every AST node and every diagnostic points at the user's text."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Span:
    """A region of one source file; lines and columns count from 1, end_column is exclusive."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def point(file: str, line: int = 1, column: int = 1) -> "Span":
        return Span(file, line, column, line, column + 1)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"
