"""The IR verifier states invariants and catches graphs that break them."""
from dataclasses import replace

import pytest

from aspc.frontend.compiler import compile_file
from aspc.ir.graph import Flow, StageKind
from aspc.ir.verify import VerificationError, verify, verify_problems
from conftest import PIPELINES, ROOT


@pytest.fixture
def graph():
    return compile_file(ROOT / "pipelines" / "tiny_grpo.aspl").graph


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_bundled_pipelines_verify(pipeline):
    assert verify_problems(compile_file(pipeline).graph) == []


def test_flow_with_a_field_the_source_does_not_produce(graph):
    bad = graph.with_flow(Flow("score", "update", ("advantages",)))
    assert any("carries ['advantages']" in p for p in verify_problems(bad))


def test_cycle_is_caught_but_weight_back_edges_are_allowed(graph):
    assert verify_problems(graph.with_flow(Flow("update", "gen", ("weights",)))) == []
    problems = verify_problems(graph.with_flow(Flow("adv", "gen", ("advantages",))))
    assert any("dataflow cycle" in p for p in problems)


def test_oversubscribed_pool_is_caught(graph):
    bad = graph.with_stage(replace(graph.stage("gen"), instances=3))
    with pytest.raises(VerificationError, match="needs 3 devices, pool has 2"):
        verify(bad)


def test_undeclared_model_is_caught(graph):
    bad = graph.with_stage(replace(graph.stage("update"), model="ghost"))
    assert any("model 'ghost' is not declared" in p for p in verify_problems(bad))


def test_graph_is_never_mutated_by_builders(graph):
    before = graph.stages()
    graph.with_stage(replace(graph.stage("gen"), instances=1))
    assert graph.stages() == before
    assert graph.stage("gen").kind is StageKind.GENERATE
