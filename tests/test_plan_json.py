"""The execution plan as a file: `from_json(to_json(plan)) == plan`, clear errors for a bad file, and
build_plan refusing an unsound plan so that none reaches a backend."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from aspc.frontend.diagnostics import AsplError
from aspc.ir.facts import ModelArch
from aspc.ir.graph import StageKind
from aspc.plan.execution_plan import PLAN_VERSION, ExecutionPlan, PlanError, PlanFormatError, build_plan
from aspc.cli.toolchain import Compiled, compile_with_passes
from aspc.ir.values import Call

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = sorted(p.name for p in (ROOT / "pipelines").glob("*.aspl"))
SCHEDULES = ["asp", "sync", "sync-naive"]


def tiny_plan() -> ExecutionPlan:
    return compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl").plan()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_plan_round_trips(pipeline, schedule):
    plan = compile_with_passes(ROOT / "pipelines" / pipeline, [], schedule).plan()
    again = ExecutionPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_round_trip_keeps_types():
    plan = ExecutionPlan.from_json(tiny_plan().to_json())
    assert isinstance(plan.stages, tuple) and isinstance(plan.stages[0].instances, tuple)
    assert all(isinstance(pair, tuple) for pair in plan.stages[0].inputs)
    assert isinstance(plan.data[0].response_lengths, Call)
    assert isinstance(plan.models[0].arch, ModelArch)
    [reward] = plan.stages_of("reward")
    assert all(isinstance(source, Call) for source in dict(reward.options)["sources"])


def edited(change) -> str:
    doc = json.loads(tiny_plan().to_json())
    change(doc)
    return json.dumps(doc)


def set_index(doc):
    doc["stages"][0]["instances"][0]["index"] = "zero"


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    ("[]", "not an execution plan"),
    (edited(lambda d: d.update(format="aspc.stage_graph")), "not an execution plan"),
    (edited(lambda d: d.update(version=PLAN_VERSION + 1)), f"version {PLAN_VERSION + 1}"),
    (edited(lambda d: d.pop("stages")), "plan: ExecutionPlan lacks stages"),
    (edited(lambda d: d["pools"][0].update(color="red")), r"plan.pools\[0\]: PoolPlan has no field color"),
    (edited(set_index), r"plan.stages\[0\].instances\[0\].index: expected int, found \"zero\""),
    (edited(lambda d: d.update(stages={})), "plan.stages: expected a list"),
    (edited(lambda d: d["models"][0].update(arch=3)), r"plan.models\[0\].arch: expected a ModelArch object"),
    (edited(lambda d: d["data"][0].update(response_lengths=3)), r"plan.data\[0\].response_lengths: expected a call"),
    (edited(lambda d: d["data"][0].update(response_lengths={"f": 1})), "needs \"call\" and \"kwargs\""),
    (edited(lambda d: d["stages"][0].update(inputs=[["a"]])), r"plan.stages\[0\].inputs\[0\]: expected a list of 2"),
])
def test_bad_plan_file_names_what_is_wrong(text, message):
    with pytest.raises(PlanFormatError, match=message):
        ExecutionPlan.from_json(text)


def test_format_error_is_a_plan_error_and_a_value_error():
    assert issubclass(PlanFormatError, PlanError) and issubclass(PlanFormatError, ValueError)


def unsound_compiled() -> Compiled:
    compiled = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", [], "asp")
    channel = compiled.graph.stages_of(StageKind.CHANNEL)[0]
    bigger = replace(channel.channel, capacity=channel.channel.capacity + 1)
    graph = compiled.graph.with_stage(channel.with_results(channel=bigger))
    return replace(compiled, run=replace(compiled.run, graph=graph))


def test_build_plan_refuses_an_unsound_plan():
    compiled = unsound_compiled()
    with pytest.raises(PlanError, match="unsound execution plan: channel .*capacity"):
        build_plan(compiled.graph, compiled.passes)


def test_unsound_plan_is_a_diagnostic_not_a_traceback():
    with pytest.raises(AsplError) as caught:
        unsound_compiled().plan()
    [diagnostic] = caught.value.diagnostics
    assert "unsound execution plan" in diagnostic.message and "compiler bug" in diagnostic.hint
