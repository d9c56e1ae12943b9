"""Print/parse round trips: the formatter (AST -> .aspl) and the JSON form of the IR."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aspc.frontend import ast
from aspc.frontend.compiler import compile_file, compile_source
from aspc.frontend.formatter import format_program
from aspc.frontend.parser import parse
from aspc.ir.printer import print_ir
from aspc.ir.serialize import from_json, to_json
from conftest import PIPELINES


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_format_then_parse_gives_the_same_ast(pipeline):
    program = parse(pipeline.read_text(), str(pipeline))
    text = format_program(program)
    assert parse(text, str(pipeline)) == program
    assert format_program(parse(text)) == text  # the formatter is a fixed point


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_json_round_trip_gives_the_same_graph(pipeline):
    graph = compile_file(pipeline).graph
    again = from_json(to_json(graph))
    assert again == graph
    assert print_ir(again) == print_ir(graph)
    assert to_json(again) == to_json(graph)


def test_formatted_source_compiles_to_the_same_ir(in_root):
    for pipeline in PIPELINES:
        original = compile_file(pipeline).graph
        text = format_program(parse(pipeline.read_text(), str(pipeline)))
        assert print_ir(compile_source(text, str(pipeline), base_dir=pipeline.parent).graph) == print_ir(original)


names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: n not in ("true", "false"))
leaves = st.one_of(
    st.integers(-10**6, 10**6).map(ast.Int),
    st.floats(allow_nan=False, allow_infinity=False, width=32).map(ast.Float),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"),
            max_size=12).map(ast.Str),
    st.booleans().map(ast.Bool),
    names.map(ast.Name),
    st.sampled_from(["2k", "16k", "1.5k", "1M"]).map(ast.Size),
)
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda xs: ast.List(tuple(xs))),
    st.tuples(names, st.lists(inner, max_size=2),
              st.lists(st.tuples(names, inner), max_size=2)).map(
        lambda t: ast.Call(t[0], tuple(t[1]), tuple(ast.Option(n, v) for n, v in t[2])))), max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(names, values), max_size=4))
def test_any_option_values_round_trip(options):
    stage = ast.Stage("s", "reward", (ast.Name("gen"),), tuple(ast.Option(n, v) for n, v in options), None)
    program = ast.Program("<input>", (ast.Pipeline("p"), stage))
    assert parse(format_program(program)) == program
