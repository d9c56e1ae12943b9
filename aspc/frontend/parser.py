"""Parse .aspl text into the located AST; syntax errors become our diagnostics.

The AST is built while lark parses (an inline transformer, no intermediate parse tree), with spans
taken from tokens. A file is parsed first by the fused lexer and driver of aspc/frontend/lexer.py; only
when that fails (a syntax error) do lark's own lexer and driver parse it again, to report. Both keep a 2 MB file to
a couple of seconds.
"""
from __future__ import annotations

import functools
import re
import threading
import unicodedata
from importlib import resources

from lark import Lark, Token, Transformer
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from aspc.frontend import ast
from aspc.frontend.comments import find_comments
from aspc.frontend.diagnostics import AsplError, Diagnostic
from aspc.frontend.lexer import ContextualLexer, parse_whole
from aspc.ir.span import Span

BOM = "\ufeff"
_DECL_START = re.compile(r"^[ \t]*(pipeline|pool|model|data|stage|schedule)[ \t]+[^\W\d]", re.M)

# How a terminal is named to a user: never a raw token type.
_FRIENDLY = {
    "NAME": "a name",
    "WORD": "a name",
    "INT": "a value",
    "FLOAT": "a value",
    "SIZE": "a value",
    "STRING": "a value",
    "LSQB": "a value",
    "TRUE": "a value",
    "FALSE": "a value",
    "EQUAL": "'='",
    "LPAR": "'('",
    "RPAR": "')'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "RSQB": "']'",
    "COMMA": "','",
    "$END": "end of file",
}
_DECL_KEYWORDS = ("PIPELINE", "POOL", "MODEL", "DATA", "STAGE", "SCHEDULE")
_PARSE_LOCK = threading.Lock()  # the one AST builder holds the file name of the parse


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    """The parser with lark's own contextual lexer: its errors are the ones users see."""
    return _build(lexer="contextual")


@functools.lru_cache(maxsize=1)
def _fast_lark() -> Lark:
    """The same parser with the leaner lexer of aspc/frontend/lexer.py, for input that parses."""
    return _build(lexer=ContextualLexer)


def _build(lexer) -> Lark:
    grammar = resources.files("aspc.grammar").joinpath("aspl.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer=lexer, start=["start", "value"], maybe_placeholders=False,
                transformer=_BUILDER)


def _parse_tree(text: str, file: str, start: str, parser: Lark | None = None):
    with _PARSE_LOCK:
        _BUILDER.file = file
        return (parser or _lark()).parse(text, start=start)


def _parse_fast(text: str, file: str):
    """The program, or None where the fast path fails (a syntax error, say): then lark's lexer
    parses again and reports."""
    try:
        with _PARSE_LOCK:
            _BUILDER.file = file
            return parse_whole(_fast_lark(), text, "start")
    except Exception:  # noqa: BLE001 -- whatever it was, the careful path below decides
        return None


def parse(text: str, file: str = "<input>") -> ast.Program:
    """Parse a whole file; raises AsplError listing every syntax error found. A leading UTF-8 byte
    order mark is skipped, as editors on Windows write one."""
    text = text.removeprefix(BOM)
    tree = _parse_fast(text, file)
    try:
        if tree is None:
            tree = _parse_tree(text, file, "start")
    except UnexpectedInput as first:
        raise AsplError(_syntax_errors(text, file, first)) from None
    except LarkError as error:  # defensive: lark raised something we did not map
        raise AsplError([Diagnostic("error", Span.point(file), f"cannot parse: {error}")]) from None
    decls = tuple(tree.children)
    return ast.Program(file, decls, find_comments(text, file, decls))


def parse_value(text: str, file: str = "<--set>") -> ast.Value:
    """Parse one value, as written on the command line after `--set key=`."""
    try:
        return _parse_tree(text, file, "value")
    except UnexpectedInput as error:
        raise AsplError([_diagnostic(error, text, file)]) from None


def _syntax_errors(text: str, file: str, first: UnexpectedInput) -> list[Diagnostic]:
    """The first error, plus errors found by re-parsing each later declaration on its own."""
    found = [_diagnostic(first, text, file)]
    for start_line, chunk in _declaration_chunks(text):
        if start_line <= first.line:
            continue
        try:
            _parse_tree(chunk, file, "start")
        except UnexpectedInput as error:
            found.append(_diagnostic(error, chunk, file, line_offset=start_line - 1))
    return found


def _declaration_chunks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each declaration; lines are counted once over the whole text."""
    starts = [m.start() for m in _DECL_START.finditer(text)]
    chunks, line, counted = [], 1, 0
    for begin, end in zip(starts, starts[1:] + [len(text)]):
        line += text.count("\n", counted, begin)
        counted = begin
        chunks.append((line, text[begin:end]))
    return chunks


def _diagnostic(error: UnexpectedInput, text: str, file: str, line_offset: int = 0) -> Diagnostic:
    line, column = max(error.line, 1), max(error.column, 1)
    width = 1
    if isinstance(error, UnexpectedToken) and error.token.type != "$END":
        width = max(1, len(str(error.token)))
        message = f"expected {_expected(error.accepts or error.expected)}, found {_found(error.token)}"
    elif isinstance(error, (UnexpectedToken, UnexpectedEOF)):
        line, column = _end_position(text)
        message = f"unexpected end of file; expected {_expected(error.expected)}"
    elif isinstance(error, UnexpectedCharacters):
        message = f"unexpected character {_char(text, error.pos_in_stream)}"
        accepted = _accepted_before(text, error.pos_in_stream)
        if accepted:
            message += f"; expected {_expected(accepted)}"
    else:
        message = "syntax error"
    span = Span(file, line + line_offset, column, line + line_offset, column + width)
    return Diagnostic("error", span, message, _hint(message))


def _accepted_before(text: str, position: int) -> set[str]:
    """The terminals the parser would accept at a position (exact, unlike LALR lookahead sets)."""
    try:
        parser = _lark().parse_interactive(text[:position], start="start")
        parser.exhaust_lexer()
        return {t for t in parser.accepts() if t != "$END"} | (
            {"PIPELINE"} if "$END" in parser.accepts() else set())
    except LarkError:
        return set()


def _expected(terminals) -> str:
    declarations = any(t in _DECL_KEYWORDS for t in terminals)
    skip = _DECL_KEYWORDS + (("$END",) if declarations else ())
    names = sorted({_terminal_name(t) for t in terminals if t not in skip})
    if "a value" in names and "a name" in names:
        names.remove("a name")
    if declarations:
        names.append("a new declaration (pipeline, pool, model, data, stage, schedule)")
    if not names:
        return "nothing more"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _terminal_name(terminal: str) -> str:
    if terminal in _FRIENDLY:
        return _FRIENDLY[terminal]
    pattern = _lark().get_terminal(terminal).pattern
    return f"'{pattern.value}'" if pattern.type == "str" else terminal.lower()


def _found(token: Token) -> str:
    if token.type in ("STRING",):
        return f"string {token}"
    if token.type in ("INT", "FLOAT", "SIZE"):
        return f"number {token}"
    return f"'{token}'"


def _char(text: str, pos: int) -> str:
    char = text[pos] if 0 <= pos < len(text) else "?"
    if char == '"':
        return "'\"' (a string that is not closed on its line)"
    return repr(char) if char.isprintable() else f"U+{ord(char):04X}"


_TYPOGRAPHIC_QUOTES = "“”„‟«»"


def _hint(message: str) -> str:
    if "'\"'" in message:
        return "close the string with \" on the same line"
    if any(f"'{quote}'" in message for quote in _TYPOGRAPHIC_QUOTES):
        return 'strings take straight double quotes: "..."'
    if "end of file" in message:
        return "a bracket or a declaration is not finished"
    return ""


def _end_position(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    while len(lines) > 1 and not lines[-1].strip():
        lines.pop()
    return len(lines), len(lines[-1]) + 1


class _ToAst(Transformer):
    """Lark rules -> ast dataclasses, called by the parser as it reduces (STYLE: never let lark
    trees leak out). Spans come from tokens; `file` is set for each parse."""

    file = "<input>"

    def _span(self, token: Token) -> Span:
        return Span(self.file, token.line, token.column, token.end_line, token.end_column)

    def _from_to(self, first: Token, last: Token) -> Span:
        return Span(self.file, first.line, first.column, last.end_line, last.end_column)

    def pipeline_decl(self, children):
        return ast.Pipeline(_name(children[0]), self._span(children[0]))

    def pool_decl(self, children):
        name, hardware, count = children
        return ast.Pool(_name(name), str(hardware), count, self._span(name), self._span(hardware))

    def model_decl(self, children):
        name, source, args, options = _split_decl(children)
        return ast.Model(_name(name), str(source), args, options, self._span(name), self._span(source))

    def data_decl(self, children):
        name, source, args, options = _split_decl(children)
        return ast.Data(_name(name), str(source), args, options, self._span(name), self._span(source))

    def stage_decl(self, children):
        name, kind, call_args = children[0], children[1], children[2]
        pool = next((c for c in children[3:] if isinstance(c, ast.Name)), None)
        options = next((c for c in children[3:] if isinstance(c, tuple)), ())
        positional = tuple(a for a in call_args if not isinstance(a, ast.Option))
        keyword = tuple(a for a in call_args if isinstance(a, ast.Option))
        return ast.Stage(_name(name), _name(kind), positional, keyword + options, pool,
                         self._span(name), self._span(kind))

    def schedule_decl(self, children):
        options = children[1] if len(children) > 1 else ()
        return ast.Schedule(str(children[0]), options, self._span(children[0]))

    def placement(self, children):
        return ast.Name(_name(children[0]), self._span(children[0]))

    def call_args(self, children):
        return _CallArgs(children[1:-1], self._span(children[-1]))

    def options(self, children):
        return tuple(children)

    def option(self, children):
        return ast.Option(_name(children[0]), children[1], self._span(children[0]))

    def int_value(self, children):
        return ast.Int(int(children[0]), self._span(children[0]))

    def float_value(self, children):
        return ast.Float(float(children[0]), self._span(children[0]))

    def size_value(self, children):
        return ast.Size(str(children[0]), self._span(children[0]))

    def string_value(self, children):
        return ast.Str(_unquote(str(children[0])), self._span(children[0]))

    def true_value(self, children):
        return ast.Bool(True, self._span(children[0]))

    def false_value(self, children):
        return ast.Bool(False, self._span(children[0]))

    def name_value(self, children):
        return ast.Name(_name(children[0]), self._span(children[0]))

    def list_value(self, children):
        return ast.List(tuple(children[1:-1]), self._from_to(children[0], children[-1]))

    def call_value(self, children):
        name, args = children
        positional = tuple(a for a in args if not isinstance(a, ast.Option))
        keyword = tuple(a for a in args if isinstance(a, ast.Option))
        span = self._span(name)
        return ast.Call(_name(name), positional, keyword, span, span.through(args.close))


class _CallArgs(list):
    """Marks the children of call_args so the declaration rules can tell them from options;
    `close` is the span of the closing parenthesis."""

    def __init__(self, items, close: Span):
        super().__init__(items)
        self.close = close


def _name(token: Token) -> str:
    """A name as Python compares identifiers: NFKC-normalized (so 'ﬁ' and 'fi' are one name)."""
    text = str(token)
    return text if text.isascii() else unicodedata.normalize("NFKC", text)


def _split_decl(children):
    """Model and data declarations: positional arguments apart, keyword ones join the options."""
    name, source = children[0], children[1]
    args = next((c for c in children[2:] if isinstance(c, _CallArgs)), None)
    options = next((c for c in children[2:] if isinstance(c, tuple)), ())
    if args is None:
        return name, source, None, options
    positional = tuple(a for a in args if not isinstance(a, ast.Option))
    keyword = tuple(a for a in args if isinstance(a, ast.Option))
    return name, source, positional, keyword + options


_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}


def _unquote(token: str) -> str:
    body = token[1:-1]
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), body)


_BUILDER = _ToAst()
