"""Pass results are typed records on the stage: absent before the pass that decides them, set by
it, and never written into a stage's (user) options."""
from dataclasses import replace

import pytest

from aspc.ir.graph import (RESULTS, Batching, ChannelSpec, DispatchSpec, MicroBatchShape, PartialRollout,
                           Placement, StageKind, Streaming, WeightSyncSpec, WeightTransfer)
from aspc.ir.serialize import from_json, to_json
from aspc.ir.verify import verify_problems
from aspc.cli.toolchain import compile_with_passes
from conftest import PIPELINES, ROOT

ALL_PASSES = ("continuous-batching,place,async-decouple{staleness=1},queue-aware-dispatch,stream{micro=8},"
              "pack{tokens=1024},partial-rollout{max_split=3}")
INSERTED = (StageKind.CHANNEL, StageKind.DISPATCH, StageKind.WEIGHT_SYNC)
PACKED = (StageKind.TRAIN, StageKind.REFERENCE, StageKind.CRITIC)


def steps(pipeline: str, passes: str = ALL_PASSES):
    return {step.spec.instance.name: step
            for step in compile_with_passes(ROOT / "pipelines" / pipeline, pipeline=passes).run.steps}


def test_place_sets_a_placement_on_every_device_stage():
    step = steps("tiny_ppo.aspl")["place"]
    device_stages = [s for s in step.after.stages() if s.pool is not None]
    assert device_stages
    assert all(s.placement is None for s in step.before.stages())
    assert all(isinstance(s.placement, Placement) for s in device_stages)
    assert {s.placement.kind for s in device_stages} <= {"dedicated", "time_shared"}
    assert all(s.placement is None for s in step.after.stages() if s.pool is None)
    [sync] = step.after.stages_of(StageKind.WEIGHT_SYNC)
    assert isinstance(sync.weight_transfer, WeightTransfer) and sync.weight_transfer.bytes > 0
    assert sync.weight_sync == WeightSyncSpec("sync", 0)


def test_pack_sets_the_micro_batch_shape_on_train_reference_and_critic():
    step = steps("tiny_ppo.aspl")["pack"]
    packed = [s for s in step.after.stages() if s.kind in PACKED]
    assert {s.kind for s in packed} == set(PACKED)
    assert all(s.micro_batching is None for s in step.before.stages())
    for stage in packed:
        shape = stage.micro_batching
        assert isinstance(shape, MicroBatchShape)
        assert shape.tokens == 1024 and shape.buckets and max(shape.buckets) == 1024
        assert shape.padding == "buckets" and 0 <= shape.padding_fraction < 1
    assert all(s.micro_batching is None for s in step.after.stages() if s.kind not in PACKED)


def test_each_pass_records_its_own_typed_result():
    by_pass = steps("tiny_grpo.aspl")
    gen = by_pass["continuous-batching"].after.stage("gen")
    assert gen.batching == Batching("continuous")
    decoupled = by_pass["async-decouple"].after
    assert decoupled.stage("gen.channel").channel == ChannelSpec(128, 64, 1)
    assert decoupled.stage("gen.weights").weight_sync == WeightSyncSpec("async", 1)
    dispatch = by_pass["queue-aware-dispatch"].after.stage("gen.dispatch").dispatch
    assert dispatch == DispatchSpec("gen", "queue_aware", True, 2)
    streamed = by_pass["stream"].after
    assert streamed.stage("score").streaming == Streaming(8)
    assert streamed.stage("update").streaming is None  # time-shares the pool with generation
    split = by_pass["partial-rollout"].after
    assert split.stage("gen").partial_rollout == PartialRollout(3)
    assert split.stage("gen.weights").weight_sync == WeightSyncSpec("async", 1, interrupt=True)


@pytest.mark.parametrize("schedule", ["asp", "sync", "sync-naive"])
@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_no_pass_writes_into_options(pipeline, schedule):
    """A stage keeps exactly its user options through every pass; inserted nodes have none."""
    run = compile_with_passes(pipeline, schedule=schedule).run
    for step in run.steps:
        for stage in step.after.stages():
            if step.before.has_stage(stage.name):
                assert stage.options == step.before.stage(stage.name).options, (step.spec.instance.name, stage.name)
            else:
                assert stage.kind in INSERTED and stage.options == (), (step.spec.instance.name, stage.name)


def test_results_are_set_by_name_and_type_only():
    stage = steps("tiny_grpo.aspl")["place"].after.stage("update")
    assert stage.with_results(streaming=Streaming(8)).results()[-1] == ("streaming", Streaming(8))
    with pytest.raises(TypeError, match="not a pass result"):
        stage.with_results(stream_micro=8)
    with pytest.raises(TypeError, match="must be a Streaming"):
        stage.with_results(streaming=8)
    assert stage.with_results(**dict.fromkeys(RESULTS)).results() == []


@pytest.mark.parametrize("schedule", ["asp", "sync", "sync-naive"])
@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_json_round_trip_keeps_pass_results(pipeline, schedule):
    graph = compile_with_passes(pipeline, schedule=schedule).graph
    again = from_json(to_json(graph))
    assert again == graph
    assert [s.results() for s in again.stages()] == [s.results() for s in graph.stages()]
    assert to_json(again) == to_json(graph)


def test_verifier_catches_misplaced_results():
    graph = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl").graph
    gen, channel = graph.stage("gen"), graph.stage("gen.channel")
    cases = [
        (graph.with_stage(gen.with_results(streaming=Streaming(8))), "a streaming result does not belong"),
        (graph.with_stage(gen.with_results(placement=Placement("dedicated", 1))), "outside pool cpu"),
        (graph.with_stage(graph.stage("score").with_results(placement=Placement("dedicated", 0))),
         "runs on no pool"),
        (graph.with_stage(channel.with_results(channel=None)), "lacks its channel record"),
        (graph.with_stage(replace(channel, options=(("capacity", 128),))), "holds options ['capacity']"),
    ]
    assert verify_problems(graph) == []
    for bad, message in cases:
        assert any(message in p for p in verify_problems(bad)), (message, verify_problems(bad))
