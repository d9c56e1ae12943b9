"""The lexer that feeds lark's LALR parser on the fast path: lark's contextual lexing, tighter.

Like lark's contextual lexer it matches, in each parser state, only the terminals that the state
accepts, and it uses lark's own scanners for them, so priorities and keywords (`x`, `on`, `true`)
resolve exactly as lark resolves them. It leaves out lark's per-token bookkeeping and error
recovery: a fifth less parse time on a large file. Input it cannot lex raises `FastPathFailed`,
and the parser parses again with lark's own lexer, whose errors users see. It reads lark
internals (written against lark 1.3): if lark changes them, parsing falls back to lark's lexer --
slower, never different (tests/test_language.py and tests/test_fuzz.py compare the two).
"""
from __future__ import annotations

from copy import copy
from typing import NamedTuple
from collections.abc import Callable, Iterator

from lark import Token
from lark.lexer import BasicLexer, Lexer


class FastPathFailed(Exception):
    """The fast lexer cannot go on; parse with lark's lexer instead."""


class _StateScanner(NamedTuple):
    """Lark's scanner for the terminals of one parser state, and what the loop needs to know."""

    match: Callable  # (text, pos) -> re.Match or None
    callback: dict[str, Callable]  # keyword retyping: a NAME that is `on` where `on` is accepted
    ignore: frozenset[str]
    multiline: frozenset[str]  # terminals that may hold a newline

    @staticmethod
    def of(lexer: BasicLexer) -> _StateScanner:
        patterns = lexer.scanner._mres  # building the scanner fills lexer.callback too
        match = patterns[0].match if len(patterns) == 1 else _first_match(patterns)
        return _StateScanner(match, lexer.callback, lexer.ignore_types, lexer.newline_types)


def _first_match(patterns) -> Callable:
    def match(text: str, pos: int):
        return next((m for m in (p.match(text, pos) for p in patterns) if m), None)
    return match


_new_token = getattr(Token, "_future_new", Token)  # lark 1.3 skips a deprecation check this way


class ContextualLexer(Lexer):
    """A lark lexer class (`Lark(..., lexer=ContextualLexer)`)."""

    __future_interface__ = 2  # lark passes the parser state, as it does to its own contextual lexer

    def __init__(self, conf):
        self.conf = conf
        self._by_state: dict[int, _StateScanner] = {}
        self._by_terminals: dict[frozenset, _StateScanner] = {}

    def lex(self, lexer_state, parser_state) -> Iterator[Token]:
        text = _whole_text(lexer_state.text)
        states, by_state = parser_state.parse_conf.parse_table.states, self._by_state
        pos, line, line_start, end = 0, 1, 0, len(text)
        while pos < end:
            state = parser_state.position
            match, callback, ignore, multiline = by_state.get(state) or self._scanner(state, states[state])
            found = match(text, pos)
            if found is None or found.end() == pos:  # no terminal fits here (or a zero-width one)
                raise FastPathFailed(pos)
            kind, value, start, pos = found.lastgroup, found.group(), pos, found.end()
            token_line, column = line, start - line_start + 1
            if kind in multiline and "\n" in value:
                line += value.count("\n")
                line_start = start + value.rindex("\n") + 1
            if kind in ignore:
                continue
            token = _new_token(kind, value, start, token_line, column, line, pos - line_start + 1, pos)
            yield callback[kind](token) if kind in callback else token

    def _scanner(self, state: int, accepts) -> _StateScanner:
        names = frozenset(n for n in accepts if n in self.conf.terminals_by_name) | set(self.conf.ignore)
        scanner = self._by_terminals.get(names)
        if scanner is None:
            conf = copy(self.conf)
            conf.terminals = [t for t in self.conf.terminals if t.name in names]
            conf.skip_validation = True
            scanner = self._by_terminals[names] = _StateScanner.of(BasicLexer(conf))
        self._by_state[state] = scanner
        return scanner


def _whole_text(text) -> str:
    """lark 1.3 hands the lexer a TextSlice, lark 1.2 a str; we only ever lex whole texts."""
    if isinstance(text, str):
        return text
    if text.start != 0 or text.end != len(text.text):
        raise FastPathFailed(0)
    return text.text
