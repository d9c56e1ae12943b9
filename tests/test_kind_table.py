"""One stage-kind table (aspc/ir/kinds.py): every kind has one row, and the passes, the controller,
the simulator's pricing and the Ascend lowering do what it says."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aspc.backends.ascend.lowering import MEGATRON_KINDS, in_trainer
from aspc.cli.toolchain import compile_with_passes
from aspc.controller.config import ControllerConfig
from aspc.controller.kinds import rule_for
from aspc.ir.graph import StageKind
from aspc.ir.kinds import JUDGE, KIND_RULES, REWARD_MODEL, ROLE_CALLS, kind_rule

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = sorted((ROOT / "pipelines").glob("*.aspl"))
RUNNABLE = ("rlhf_32b_rm", "rlaif_7b_judge", "tiny_agentic", "tiny_ppo", "grpo_7b")


def _plan(name: str, schedule: str | None = None):
    return compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", schedule=schedule).plan()


def test_every_stage_kind_has_exactly_one_row():
    assert list(KIND_RULES) == list(StageKind)
    assert all(rule.kind is kind for kind, rule in KIND_RULES.items())
    assert {JUDGE.kind, REWARD_MODEL.kind} == {StageKind.REWARD}


def test_inserted_kinds_are_the_ones_no_user_writes():
    inserted = {k for k, r in KIND_RULES.items() if r.inserted}
    assert inserted == {StageKind.CHANNEL, StageKind.DISPATCH, StageKind.WEIGHT_SYNC}
    assert all(r.produces is None and not r.dispatched for r in KIND_RULES.values() if r.inserted)


def test_a_reward_stage_rule_follows_its_sources():
    assert kind_rule("reward", ["rule"]).role is None
    assert kind_rule("reward", ["model"]).role == "forward_model"
    assert kind_rule("reward", ["model", "judge"]).priced_as == "judge"


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_the_dispatch_pass_dispatches_exactly_the_kinds_the_table_dispatches(path):
    graph = compile_with_passes(path).graph
    targets = {s.dispatch.target for s in graph.stages_of(StageKind.DISPATCH)}
    for stage in graph.stages():
        if KIND_RULES[stage.kind].inserted:
            continue
        wanted = KIND_RULES[stage.kind].dispatched and stage.instances > 1
        assert (stage.name in targets) == wanted, stage.name


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_streamed_and_packed_stages_are_the_tables(path):
    plan = compile_with_passes(path).plan()
    for stage in plan.stages:
        rule = rule_for(stage)
        assert stage.stream_micro is None or rule.streamed, stage.name
        assert (stage.micro_batching is not None) == rule.packed, stage.name


@pytest.mark.parametrize("name", RUNNABLE)
def test_the_controller_reads_every_dispatch_and_channel_record(name):
    plan = _plan(name)
    config = ControllerConfig.from_plan(plan, steps=1)
    gen, train = plan.stages_of("generate")[0], plan.stages_of("train")[0]
    for dispatch in plan.dispatches:  # the controller routes generation only
        assert dispatch.target == gen.name and rule_for(gen).dispatched
        assert (config.policy, config.group_affinity) == (dispatch.policy, dispatch.group_affinity)
    feeding = dict(train.inputs)["responses"]
    for channel in plan.channels:  # the staleness gate is the channel's: change it, the controller follows
        if channel.name != feeding:
            continue
        moved = dataclasses.replace(channel, staleness=channel.staleness + 2)
        other = dataclasses.replace(plan, channels=tuple(moved if c is channel else c for c in plan.channels))
        assert ControllerConfig.from_plan(other, steps=1).staleness == config.staleness + 2


def test_the_rlhf_32b_rm_plan_has_no_record_nothing_reads():
    for schedule in ("asp", "sync"):
        plan = _plan("rlhf_32b_rm", schedule)
        assert [d.target for d in plan.dispatches] == ["gen"]  # no score.dispatch: the RM's units go to a free executor
        assert not any(src.endswith(".dispatch") for s in plan.stages if s.kind != "generate" for _, src in s.inputs)
    plan = _plan("rlhf_32b_rm")
    assert [c.name for c in plan.channels] == [dict(plan.stage("update").inputs)["responses"]]


def test_the_controller_routes_before_training_what_the_table_says():
    plan = _plan("tiny_ppo")
    config = ControllerConfig.from_plan(plan, steps=1)
    routed = {s.kind for s in config.forward_stages}
    assert routed == {k.value for k, r in KIND_RULES.items() if r.before_train}
    assert all(s.role == rule_for(plan.stage(s.name)).role for s in config.forward_stages)


def test_drivers_call_the_tables_trainer_methods():
    from aspc.drivers.local.processes import ProcessLearner
    assert ProcessLearner.PASSES == ROLE_CALLS == ("reward", "reference", "values", "train")


def test_the_ascend_lowering_runs_what_the_table_says():
    assert set(MEGATRON_KINDS) == {"train", "reference", "critic"}
    plan = _plan("rlhf_32b_rm")
    assert in_trainer(plan, plan.stage("ref_lp")) and not in_trainer(plan, plan.stage("score"))
    assert rule_for(plan.stage("score")).ascend.megatron_role == "megatron-forward"
