"""Parse .aspl text into the located AST; syntax errors become our diagnostics."""
from __future__ import annotations

import functools
import re
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from aspc import ast
from aspc.diagnostics import AsplError, Diagnostic
from aspc.span import Span

_DECL_START = re.compile(r"^[ \t]*(pipeline|pool|model|data|stage|schedule)[ \t]+[A-Za-z_]", re.M)

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


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = resources.files("aspc.grammar").joinpath("aspl.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=True, start=["start", "value"],
                maybe_placeholders=False)


def parse(text: str, file: str = "<input>") -> ast.Program:
    """Parse a whole file; raises AsplError listing every syntax error found."""
    try:
        tree = _lark().parse(text, start="start")
    except UnexpectedInput as first:
        raise AsplError(_syntax_errors(text, file, first)) from None
    except LarkError as error:  # defensive: lark raised something we did not map
        raise AsplError([Diagnostic("error", Span.point(file), f"cannot parse: {error}")]) from None
    return ast.Program(file, tuple(_ToAst(file).transform(tree).children))


def parse_value(text: str, file: str = "<--set>") -> ast.Value:
    """Parse one value, as written on the command line after `--set key=`."""
    try:
        return _ToAst(file).transform(_lark().parse(text, start="value"))
    except UnexpectedInput as error:
        raise AsplError([_diagnostic(error, text, file)]) from None


def _syntax_errors(text: str, file: str, first: UnexpectedInput) -> list[Diagnostic]:
    """The first error, plus errors found by re-parsing each later declaration on its own."""
    found = [_diagnostic(first, text, file)]
    for start_line, chunk in _declaration_chunks(text):
        if start_line <= first.line:
            continue
        try:
            _lark().parse(chunk, start="start")
        except UnexpectedInput as error:
            found.append(_diagnostic(error, chunk, file, line_offset=start_line - 1))
    return found


def _declaration_chunks(text: str) -> list[tuple[int, str]]:
    starts = [m.start() for m in _DECL_START.finditer(text)]
    chunks = []
    for begin, end in zip(starts, starts[1:] + [len(text)]):
        chunks.append((text.count("\n", 0, begin) + 1, text[begin:end]))
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


def _hint(message: str) -> str:
    if "'\"'" in message:
        return "close the string with \" on the same line"
    if "end of file" in message:
        return "a bracket or a declaration is not finished"
    return ""


def _end_position(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    while len(lines) > 1 and not lines[-1].strip():
        lines.pop()
    return len(lines), len(lines[-1]) + 1


class _ToAst(Transformer):
    """Lark tree -> ast dataclasses, at once (STYLE: never let lark trees leak out)."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _span(self, item) -> Span:
        meta = getattr(item, "meta", item)
        if getattr(meta, "empty", False):
            return Span.point(self.file)
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    @v_args(meta=True)
    def pipeline_decl(self, meta, children):
        return ast.Pipeline(str(children[0]), self._span(children[0]))

    @v_args(meta=True)
    def pool_decl(self, meta, children):
        name, hardware, count = children
        return ast.Pool(str(name), str(hardware), count, self._span(name), self._span(hardware))

    @v_args(meta=True)
    def model_decl(self, meta, children):
        name, source, args, options = _split_decl(children)
        return ast.Model(str(name), str(source), args, options, self._span(name), self._span(source))

    @v_args(meta=True)
    def data_decl(self, meta, children):
        name, source, args, options = _split_decl(children)
        return ast.Data(str(name), str(source), args, options, self._span(name), self._span(source))

    @v_args(meta=True)
    def stage_decl(self, meta, children):
        name, kind, call_args = children[0], children[1], children[2]
        pool = next((c for c in children[3:] if isinstance(c, ast.Name)), None)
        options = next((c for c in children[3:] if isinstance(c, tuple)), ())
        positional = tuple(a for a in call_args if not isinstance(a, ast.Option))
        keyword = tuple(a for a in call_args if isinstance(a, ast.Option))
        return ast.Stage(str(name), str(kind), positional, keyword + options, pool,
                         self._span(name), self._span(kind))

    @v_args(meta=True)
    def schedule_decl(self, meta, children):
        options = children[1] if len(children) > 1 else ()
        return ast.Schedule(str(children[0]), options, self._span(children[0]))

    def placement(self, children):
        return ast.Name(str(children[0]), self._span(children[0]))

    def call_args(self, children):
        return _CallArgs(children)

    def options(self, children):
        return tuple(children)

    def option(self, children):
        return ast.Option(str(children[0]), children[1], self._span(children[0]))

    def int_value(self, children):
        return ast.Int(int(children[0]), self._span(children[0]))

    def float_value(self, children):
        return ast.Float(float(children[0]), self._span(children[0]))

    def size_value(self, children):
        return ast.Size(str(children[0]), self._span(children[0]))

    def string_value(self, children):
        return ast.Str(_unquote(str(children[0])), self._span(children[0]))

    @v_args(meta=True)
    def true_value(self, meta, children):
        return ast.Bool(True, self._span(meta))

    @v_args(meta=True)
    def false_value(self, meta, children):
        return ast.Bool(False, self._span(meta))

    def name_value(self, children):
        return ast.Name(str(children[0]), self._span(children[0]))

    @v_args(meta=True)
    def list_value(self, meta, children):
        return ast.List(tuple(children), self._span(meta))

    def call_value(self, children):
        name, args = children
        positional = tuple(a for a in args if not isinstance(a, ast.Option))
        keyword = tuple(a for a in args if isinstance(a, ast.Option))
        return ast.Call(str(name), positional, keyword, self._span(name))


class _CallArgs(list):
    """Marks the children of call_args so the declaration rules can tell them from options."""


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
