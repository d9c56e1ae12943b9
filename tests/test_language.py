"""Parser and checker behaviour: values, keywords as names, overrides, defaults."""
import dataclasses

import pytest

from aspc.frontend import ast, parser
from aspc.frontend.compiler import compile_source
from aspc.frontend.diagnostics import AsplError
from aspc.ir.graph import StageKind
from aspc.frontend.parser import parse, parse_value
from conftest import PIPELINES

TINY = """
pipeline t
pool cpu = cpu x 2
model actor = custom { layers = 1, hidden = 32, heads = 2 }
data prompts = synthetic("copy") { group = 2, max_response = 2k }
stage gen = generate(actor, prompts) on cpu
stage score = reward(gen, rule = "exact_match")
stage adv = advantage(score)
stage update = train(actor, gen, adv) on cpu { micro_tokens = 4k }
"""


def errors(text, overrides=()):
    with pytest.raises(AsplError) as info:
        compile_source(text, "t.aspl", list(overrides))
    return [d.message for d in info.value.diagnostics if d.severity == "error"]


@pytest.mark.parametrize("text, value", [
    ("2k", 2048), ("16k", 16384), ("1.5k", 1536), ("1M", 1048576), ("30k", 30720), ("-3", -3),
])
def test_sizes_and_integers(text, value):
    assert parse_value(text).value == value


def test_strings_unescape_and_comments_are_ignored():
    program = parse('pipeline p # comment\ndata d = jsonl("a \\"b\\" \\\\ c") # more\n')
    assert program.decls[1].args[0].value == 'a "b" \\ c'


def test_keywords_are_contextual_so_they_can_be_names():
    program = parse("pipeline data\npool x = cpu x 2\nstage stage = reward(x) on pool\n")
    assert program.decls[0].name == "data"
    assert program.decls[2].pool.name == "pool"


def test_spans_point_at_the_name():
    program = parse("pipeline p\n\n  pool   rollout = 910b3 x 4\n", "f.aspl")
    span = program.decls[1].span
    assert (span.file, span.line, span.column, span.end_column) == ("f.aspl", 3, 10, 17)


def test_defaults_fill_in_and_derive():
    graph = compile_source(TINY, "t.aspl").graph
    gen = graph.stage("gen")
    assert gen.option("max_tokens") == 2048  # from the data's max_response
    assert gen.option("temperature") == 1.0
    assert graph.models["actor"].arch.head_dim == 16
    assert graph.schedule.kind == "asp" and graph.schedule.option("staleness") == 1
    assert graph.stage("score").option("sources")[0].get("name") == "exact_match"
    assert graph.stage("adv").kind is StageKind.ADVANTAGE


def test_single_pool_is_the_default_placement():
    graph = compile_source(TINY, "t.aspl").graph
    assert graph.stage("gen").pool == "cpu"
    assert graph.stage("score").pool is None  # rule rewards run on the host


def test_overrides_by_name_kind_and_schedule():
    graph = compile_source(TINY, "t.aspl", ["gen.temperature=0.5", "train.lr=1e-4",
                                            "schedule.staleness=3", "cpu.count=4"]).graph
    assert graph.stage("gen").option("temperature") == 0.5
    assert graph.stage("update").option("lr") == 1e-4
    assert graph.schedule.option("staleness") == 3
    assert graph.pools["cpu"].count == 4


def test_overrides_are_checked_like_source():
    assert errors(TINY, ["gen.temprature=1"]) == ["unknown option 'temprature' for stage 'gen' (generate)"]


def test_several_pools_need_explicit_placement():
    text = TINY.replace("pool cpu = cpu x 2", "pool cpu = cpu x 2\npool other = cpu x 2")
    text = text.replace("on cpu\n", "\n", 1)
    assert any("needs a pool" in m for m in errors(text))


def test_trained_model_must_generate_its_responses():
    text = TINY.replace("model actor", "model other = custom { layers = 1, hidden = 32, heads = 2 }\nmodel actor")
    text = text.replace("generate(actor", "generate(other")
    assert any("on responses that 'gen' generates with 'other'" in m for m in errors(text))


def test_environment_stage_is_carried_into_the_ir():
    text = TINY.replace("stage score = reward(gen,", 'stage env = environment(gen) { tools = '
                        '[tool("calc", python = "tools:calc", timeout = 5)], max_turns = 3 }\n'
                        "stage score = reward(env,").replace("train(actor, gen, adv)", "train(actor, env, adv)")
    graph = compile_source(text, "t.aspl").graph
    env = graph.stage("env")
    assert env.kind is StageKind.ENVIRONMENT
    assert env.option("max_turns") == 3
    assert env.option("tools")[0].get("timeout") == 5.0
    assert graph.inputs("update")["responses"] == "env"


def test_reward_sources_combine_with_weights():
    text = TINY.replace('reward(gen, rule = "exact_match")',
                        'reward(gen) { sources = [rule("exact_match", weight = 0.7), '
                        'python("my.mod:score", weight = 0.3)] }')
    sources = compile_source(text, "t.aspl").graph.stage("score").option("sources")
    assert [(s.func, s.get("weight")) for s in sources] == [("rule", 0.7), ("python", 0.3)]


def test_all_errors_are_reported_at_once():
    text = TINY.replace("group = 2", "group = 0").replace("on cpu\n", "on cpu { tp = 0 }\n", 1)
    assert len(errors(text)) == 2


def test_ast_nodes_are_frozen():
    program = parse("pipeline p\n")
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        program.decls[0].name = "q"
    assert isinstance(program.decls[0], ast.Pipeline)


def test_names_are_python_identifiers_in_any_script():
    text = TINY.replace("pool cpu", "pool 训练").replace("on cpu", "on 训练")
    text = text.replace("prompts", "données")
    graph = compile_source("pipeline 管线" + text.replace("pipeline t", ""), "t.aspl").graph
    assert graph.pipeline == "管线"
    assert graph.stage("gen").pool == "训练" and graph.stage("gen").data == "données"


def test_names_are_compared_after_nfkc_normalization_as_python_does():
    program = parse("pipeline p\nstage \ufb01x = reward(fix)\n")  # U+FB01 is the 'fi' ligature
    assert program.decls[1].name == "fix"


def test_a_byte_order_mark_is_skipped():
    assert parse("\ufeffpipeline p\n").decls[0].name == "p"
    assert compile_source("\ufeff" + TINY, "t.aspl").graph.pipeline == "t"


def test_options_keep_where_they_were_written_in_the_ir():
    graph = compile_source(TINY, "t.aspl", ["update.lr=1e-4"]).graph
    group = graph.data["prompts"].option_span("group")
    assert (group.line, group.column, group.end_column) == (5, 36, 45)  # `group = 2`
    lr = graph.stage("update").option_span("lr")
    assert (lr.file, lr.line, lr.column, lr.end_column) == ("<--set>", 1, 8, 15)  # `lr=1e-4`
    assert graph.stage("update").option_span("kl") is None  # not written: the default


def test_an_error_an_override_causes_points_at_the_set_and_at_the_value_it_replaced():
    with pytest.raises(AsplError) as info:
        compile_source(TINY.replace("on cpu\n", "on cpu { tp = 2 }\n", 1), "t.aspl", ["gen.tp=3"])
    [error] = info.value.diagnostics
    assert error.message.startswith("stage 'gen' needs 3 devices (instances 1 x tp 3")
    assert (error.span.file, error.span.line, error.span.column) == ("<--set>", 1, 5)
    pool_note, (replaced, note) = error.notes
    assert pool_note[1] == "pool 'cpu' is declared here"
    assert (replaced.file, replaced.line, replaced.column) == ("t.aspl", 6, 47)
    assert note == "--set gen.tp=3 replaces the value written here"


TRICKY = [
    "pipeline data\npool x = cpu x 2\nstage stage = reward(x) on pool { on = true, x = false }\n",
    'model m = qwen2.5-7b { dtype = bf16 }\nschedule sync-naive\ndata d = jsonl("a \\"b\\" c")\n',
    "stage s = t(a, b = [1, -2, 3.5, 1e-6, 2k, 1.5M, .5], c = f(g(1), h = [x]),)\r\n# end\n",
    "pipeline 训练\n\tpool données = 910b3 x 8 # comment\n\n",
    "",
]


@pytest.mark.parametrize("text", [p.read_text() for p in PIPELINES] + TRICKY)
def test_the_fast_lexer_gives_what_larks_own_lexer_gives(text):
    fast = parser._parse_fast(text, "f.aspl")
    slow = parser._parse_tree(text, "f.aspl", "start")
    assert fast is not None
    assert _with_spans(fast.children) == _with_spans(slow.children)


def _with_spans(node):
    """A node compared with every span in it (the AST's own equality ignores spans)."""
    if isinstance(node, (list, tuple)):
        return [_with_spans(n) for n in node]
    if not dataclasses.is_dataclass(node):
        return node
    return [type(node).__name__] + [_with_spans(getattr(node, f.name)) for f in dataclasses.fields(node)]


def test_a_syntax_error_is_reported_by_larks_own_lexer():
    assert parser._parse_fast("pipeline p\npool cpu = cpu x\n", "f.aspl") is None
    with pytest.raises(AsplError) as info:
        parse("pipeline p\npool cpu = cpu x\n", "f.aspl")
    assert [d.message for d in info.value.diagnostics] == ["unexpected end of file; expected a value"]
