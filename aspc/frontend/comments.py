"""The comments of an .aspl file, found beside the parse so that the formatter can keep them.

The grammar drops `# ...` (it is insignificant to the language); here each comment is found on its
line (outside a string: strings do not span lines) and anchored to a declaration, because the
formatter prints each declaration on one line:
- a comment on a line of its own goes above the first declaration that ends at or after it: the
  one it precedes, or the one whose block it sits inside;
- a comment after code on its line stays at the end of that declaration's line; a declaration
  written over several lines with several such comments gets them above it instead.
"""
from __future__ import annotations

import bisect
from collections import Counter

from aspc.frontend import ast
from aspc.ir.span import Span


def find_comments(text: str, file: str, decls: tuple[ast.Decl, ...]) -> tuple[ast.Comment, ...]:
    found, code_lines = _scan(text)
    if not found:
        return ()
    ends = _decl_ends(decls, code_lines)
    placed = [_placed(line, column, comment, trailing, decls, ends, file)
              for line, column, comment, trailing in found]
    crowded = Counter(c.anchor for c in placed if c.trailing)
    return tuple(ast.Comment(c.text, c.anchor, False, c.span) if c.trailing and crowded[c.anchor] > 1 else c
                 for c in placed)


def _scan(text: str) -> tuple[list[tuple[int, int, str, bool]], list[int]]:
    """(line, column, text, after code) of each comment, and the numbers of the lines with code."""
    comments, code_lines = [], []
    for number, line in enumerate(text.split("\n"), start=1):
        at = _comment_start(line)
        code = line if at < 0 else line[:at]
        if code.strip():
            code_lines.append(number)
        if at >= 0:
            comments.append((number, at + 1, line[at:].rstrip(), bool(code.strip())))
    return comments, code_lines


def _comment_start(line: str) -> int:
    """The index of the `#` that starts a comment, or -1; a `#` inside a string is text."""
    at = line.find("#")
    if at < 0 or '"' not in line[:at]:
        return at
    in_string = escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif in_string and char == "\\":
            escaped = True
        elif char == '"':
            in_string = not in_string
        elif char == "#" and not in_string:
            return i
    return -1


def _decl_ends(decls: tuple[ast.Decl, ...], code_lines: list[int]) -> list[int]:
    """The last line with code of each declaration: the line before the next one starts, or later."""
    starts = [d.span.line if d.span else 0 for d in decls]
    ends = []
    for i, start in enumerate(starts):
        limit = starts[i + 1] if i + 1 < len(starts) else float("inf")
        last = bisect.bisect_left(code_lines, limit) - 1
        ends.append(max(start, code_lines[last]) if last >= 0 else start)
    return ends


def _placed(line: int, column: int, text: str, trailing: bool, decls, ends: list[int], file: str) -> ast.Comment:
    index = bisect.bisect_left(ends, line)  # the first declaration that ends at or after the comment
    anchor = ast.decl_key(decls[index]) if index < len(decls) else None
    span = Span(file, line, column, line, column + len(text))
    return ast.Comment(text, anchor, trailing and anchor is not None, span)
