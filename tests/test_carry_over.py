"""The scheduling of issue 34 on the real CPU runtime: a time-shared pool's generation phase that ends
at its tail and carries the requests in flight over the learner's turn (partial rollout), and sync's
mini-batches (several optimizer steps per generation phase). No sample is lost or trained twice, and
every trained sample is within the staleness bound. (The simulator takes the same actions:
tests/test_differential.py, plans time_shared_carried and mini_batched.)"""
import json
import math

import pytest

from aspc.backends.cpu.executors import CpuExecutors
from aspc.cli.toolchain import compile_with_passes
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from conftest import ROOT

STEPS = 4


def run(tmp_path, schedule: str, overrides: list[str], workers: str = "threads"):
    plan = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", overrides, schedule).plan()
    assert plan.stages_of("generate")[0].placement == "time_shared"
    metrics = tmp_path / "m.jsonl"
    options = RunOptions(steps=STEPS, warmstart_steps=0, seed=3, metrics_path=metrics, workers=workers)
    runtime = LocalRuntime(plan, ROOT / "pipelines", options, CpuExecutors)
    runtime.build()
    runtime.run()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return runtime, plan, rows


def assert_every_sample_trained_once(runtime, plan, rows, bound: int):
    controller = runtime.controller
    data = plan.dataset(plan.stages_of("generate")[0].data)
    trained = [s for s in controller.used if s[0] < STEPS]
    assert len(trained) == STEPS * data.prompts_per_step * data.group  # none lost
    assert sum(controller.staleness.values()) == len(controller.used)  # each delivered once: none trained twice
    assert max(controller.staleness) <= bound
    assert len(rows) == STEPS and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_time_shared_pool_carries_its_tail_over_the_learners_turn(tmp_path, workers):
    overrides = ["schedule.partial_rollout=1", "prompts.max_response=64"]
    runtime, plan, rows = run(tmp_path, "asp", overrides, workers)
    assert_every_sample_trained_once(runtime, plan, rows, bound=1)
    carried = runtime.controller.gen.splits
    assert carried, "no generation phase ended at its tail"
    assert max(carried.values()) <= 1  # partial_rollout = 1: split once at most


def test_sync_with_two_mini_batches_trains_two_steps_per_generation_phase(tmp_path):
    runtime, plan, rows = run(tmp_path, "sync", ["update.mini_batches=2"])
    assert_every_sample_trained_once(runtime, plan, rows, bound=1)
    assert set(runtime.controller.staleness) == {0, 1}  # a phase's second step trains after the first's update
    starts = runtime.controller.gen.start_version
    assert {starts[s] for s in runtime.controller.used if s[0] in (2, 3)} == {2}  # one phase, one version
