"""The fast path of parsing: lark's contextual lexing and LALR(1) driver, fused into one loop.

Like lark's contextual lexer it matches, in each parser state, only the terminals that the state
accepts, and it uses lark's own scanners for them, so priorities and keywords (`x`, `on`, `true`)
resolve exactly as lark resolves them. Like lark's LALR driver it shifts and reduces by lark's own
parse table and calls lark's own callbacks (the inline AST builder), so the result is the same
value. It leaves out lark's per-token bookkeeping, the generator between lexer and parser and
error recovery: a quarter less parse time on a large file (bench/RESULTS.md, the front end). Input it
cannot lex or parse raises `FastPathFailed`, and the parser parses again with lark's own lexer and
driver, whose errors users see. It reads lark internals (written against lark 1.3): if lark changes
them, parsing falls back to lark's own -- slower, never different (tests/test_language.py and
tests/test_fuzz.py compare the two).
"""
from __future__ import annotations

from copy import copy
from typing import NamedTuple
from collections.abc import Callable, Iterator

from lark import Token
from lark.lexer import BasicLexer, Lexer
from lark.parsers.lalr_analysis import Shift


class FastPathFailed(Exception):
    """The fast path cannot go on; parse with lark's lexer and driver instead."""


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
    """A lark lexer class (`Lark(..., lexer=ContextualLexer)`): the per-state scanners of
    `parse_whole`, built as its parser states are first reached."""

    __future_interface__ = 2  # lark passes the parser state, as it does to its own contextual lexer

    def __init__(self, conf):
        self.conf = conf
        self._by_state: dict[int, _StateScanner] = {}
        self._by_terminals: dict[frozenset, _StateScanner] = {}

    def lex(self, lexer_state, parser_state) -> Iterator[Token]:
        """Not lark's token stream: `parse_whole` lexes and parses in one loop."""
        raise FastPathFailed(0)

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


class _Reduce(NamedTuple):
    size: int  # how many values the rule pops
    origin: str  # the nonterminal it makes
    build: Callable  # lark's callback for the rule: the inline AST builder behind its child filter


def parse_whole(parser, text: str, start: str):
    """The value lark's `parser.parse(text, start=start)` returns, for a Lark built with
    `lexer=ContextualLexer`; raises FastPathFailed where lark's own path must decide."""
    frontend = parser.parser
    lexer, table, callbacks = frontend.lexer, frontend.parser.parser.parse_table, frontend.parser.parser.callbacks
    actions, end_state = _actions(table, callbacks), table.end_states[start]
    states, by_state, shifted = table.states, lexer._by_state, _terminal_builders(callbacks)
    state_stack, value_stack = [table.start_states[start]], []
    pos, line, line_start, end = 0, 1, 0, len(text)
    while pos < end:
        state = state_stack[-1]
        match, callback, ignore, multiline = by_state.get(state) or lexer._scanner(state, states[state])
        found = match(text, pos)
        if found is None or found.end() == pos:  # no terminal fits here (or a zero-width one)
            raise FastPathFailed(pos)
        kind, value, begin, pos = found.lastgroup, found.group(), pos, found.end()
        token_line, column = line, begin - line_start + 1
        if kind in multiline and "\n" in value:
            line += value.count("\n")
            line_start = begin + value.rindex("\n") + 1
        if kind in ignore:
            continue
        token = _new_token(kind, value, begin, token_line, column, line, pos - line_start + 1, pos)
        if kind in callback:
            token = callback[kind](token)
            kind = token.type
        _reduce_until_shift(actions, state_stack, value_stack, kind)
        value_stack.append(shifted[kind](token) if kind in shifted else token)
    _reduce_until_shift(actions, state_stack, value_stack, "$END", end_state)
    return value_stack[-1]


def _reduce_until_shift(actions, state_stack: list, value_stack: list, kind: str, end_state=None) -> None:
    """Reduce by every rule the table says for `kind`, then push the state that shifts it (the
    token's value is the caller's to push). With `end_state`: reduce until the stack is there."""
    while True:
        try:
            shift, arg = actions[state_stack[-1]][kind]
        except KeyError:
            raise FastPathFailed(kind) from None
        if shift:
            state_stack.append(arg)
            return
        size, origin, build = arg
        if size:
            children = value_stack[-size:]
            del state_stack[-size:], value_stack[-size:]
        else:
            children = []
        goto = actions[state_stack[-1]][origin][1]
        state_stack.append(goto)
        value_stack.append(build(children))
        if goto == end_state:
            return


_TABLES: dict[int, tuple] = {}  # id(parse table) -> (the table, its actions), built once per parser


def _actions(table, callbacks) -> dict[int, dict[str, tuple]]:
    """lark's table with each reduce's rule read once: state -> symbol -> (True, next state) or
    (False, _Reduce). lark hashes and compares its Rule objects in Python on every reduce, and its
    symbol names are Tokens (str subclasses compared in Python): here they are plain str."""
    kept = _TABLES.get(id(table))
    if kept is not None and kept[0] is table:
        return kept[1]
    reduces, actions = {}, {}
    for state, row in table.states.items():
        actions[state] = {str(symbol): _action(action, arg, callbacks, reduces)
                          for symbol, (action, arg) in row.items()}
    _TABLES[id(table)] = (table, actions)
    return actions


def _action(action, arg, callbacks, reduces: dict) -> tuple:
    if action is Shift:
        return True, arg
    if arg not in reduces:
        reduces[arg] = _Reduce(len(arg.expansion), str(arg.origin.name), callbacks[arg])
    return False, reduces[arg]


def _terminal_builders(callbacks) -> dict[str, Callable]:
    """The callbacks lark calls on a shifted terminal (a transformer method named after it)."""
    return {name: build for name, build in callbacks.items() if isinstance(name, str)}
