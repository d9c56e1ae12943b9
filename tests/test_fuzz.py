"""Property tests: mutated programs only ever produce our diagnostics, never another exception."""
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspc.frontend.compiler import compile_file, compile_source
from aspc.frontend.diagnostics import AsplError, render_all
from conftest import PIPELINES

SOURCES = [p.read_text() for p in PIPELINES]
TOKEN = re.compile(r'"[^"\n]*"|[A-Za-z0-9_.\-]+|\S')
VOCAB = ["pipeline", "pool", "model", "data", "stage", "schedule", "on", "x", "=", "(", ")", "{",
         "}", "[", "]", ",", "frozen", "generate", "train", "reward", "advantage", "reference",
         "critic", "environment", "0", "-1", "2k", "1e9", "1e999", "0.5", '"', '"s"', "true",
         "gen", "actor", "prompts", "tp", "group", "staleness", "\n", "#", "\u00e4", "\x00", "\t"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tokens(text):
    return [(m.start(), m.end()) for m in TOKEN.finditer(text)]


def compiles_or_diagnoses(text, file="fuzz.aspl"):
    try:
        compile_source(text, file)
    except AsplError as error:
        assert error.diagnostics
        assert all(d.severity in ("error", "warning") for d in error.diagnostics)
        assert render_all(error.diagnostics, {file: text})  # rendering never fails either


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(SOURCES))
    spans = tokens(text)
    for _ in range(draw(st.integers(1, 4))):
        spans = tokens(text)
        if not spans:
            break
        i = draw(st.integers(0, len(spans) - 1))
        start, end = spans[i]
        op = draw(st.sampled_from(["delete", "insert", "replace", "swap", "truncate"]))
        if op == "delete":
            text = text[:start] + text[end:]
        elif op == "insert":
            text = text[:start] + draw(st.sampled_from(VOCAB)) + " " + text[start:]
        elif op == "replace":
            text = text[:start] + draw(st.sampled_from(VOCAB)) + text[end:]
        elif op == "swap":
            j = draw(st.integers(0, len(spans) - 1))
            (a, b), (c, d) = sorted([spans[i], spans[j]])
            if b <= c:
                text = text[:a] + text[c:d] + text[b:c] + text[a:b] + text[d:]
        else:
            text = text[:start]
    return text


@FUZZ
@given(mutated())
def test_token_mutations_only_raise_diagnostics(text):
    compiles_or_diagnoses(text)


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_only_raises_diagnostics(text):
    compiles_or_diagnoses(text)


@FUZZ
@given(st.sampled_from(SOURCES), st.binary(min_size=1, max_size=40), st.integers(0, 2000))
def test_random_bytes_only_raise_diagnostics(tmp_path_factory, source, noise, at):
    data = source.encode()
    at = min(at, len(data))
    path = tmp_path_factory.mktemp("fuzz") / "bytes.aspl"
    path.write_bytes(data[:at] + noise + data[at:])
    try:
        compile_file(path)
    except AsplError as error:
        assert error.diagnostics


def test_empty_file_is_a_diagnostic():
    try:
        compile_source("", "empty.aspl")
    except AsplError as error:
        assert "missing `pipeline NAME`" in error.diagnostics[0].message
    else:
        raise AssertionError("an empty file must not compile")


def test_very_long_file_only_raises_diagnostics():
    compiles_or_diagnoses(SOURCES[0] * 200)  # 200 copies: duplicate names everywhere
    compiles_or_diagnoses("stage " * 20000)
    compiles_or_diagnoses("(" * 5000)


def test_fuzz_through_the_cli_exits_1(aspc, tmp_path):
    bad = tmp_path / "bad.aspl"
    bad.write_bytes(b"pipeline p\nstage = = \xff\xfe\n")
    result = aspc("check", str(bad))
    assert result.exit_code == 1
    assert "Traceback" not in result.output


@FUZZ
@given(st.one_of(mutated(), st.text(max_size=300)))
def test_the_fast_lexer_parses_exactly_what_larks_lexer_parses(text):
    from aspc.frontend import parser
    from test_language import _with_spans

    fast = parser._parse_fast(text, "fuzz.aspl")
    try:
        slow = parser._parse_tree(text, "fuzz.aspl", "start")
    except Exception:  # noqa: BLE001 -- a syntax error: the fast path must not accept it either
        assert fast is None
        return
    assert fast is not None and _with_spans(fast.children) == _with_spans(slow.children)
