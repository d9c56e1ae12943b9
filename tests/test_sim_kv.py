"""The simulator's KV physics: no instance holds more KV than fits; what does not fit waits or is
preempted and computed again (booked `preempt`), as vLLM's scheduler does; prefill pays for
attention over its context; a colocated engine gets the memory share its launch gives it."""
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspc.backends.ascend.lowering import lower
from aspc.backends.sim.instance import GenInstance
from aspc.backends.sim.pricing import RooflinePricing
from aspc.cli.toolchain import compile_with_passes
from aspc.controller.events import Request
from aspc.costmodel.roofline import GenerationCost, engine_memory, hardware_of, dtype_bytes
from aspc.drivers.sim.result import simulate
from conftest import ROOT

PAPER = ["grpo_7b", "grpo_7b_colocated", "dapo_32b", "grpo_30b_moe", "r1_zero_671b", "rlhf_32b_rm", "agentic_7b"]


def compiled(name, schedule, overrides=()):
    return compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", list(overrides), schedule).plan()


def assert_kv_fits(result):
    assert result.kv, "the simulation reported no generation instance"
    for peak, budget, _ in result.kv:
        assert peak <= budget, f"an instance held {peak:.0f} tokens of KV in a cache of {budget:.0f}"


@pytest.mark.parametrize("name", PAPER)
@pytest.mark.parametrize("schedule", ["sync", "asp"])
def test_no_instance_of_a_bundled_workload_holds_more_kv_than_fits(name, schedule):
    plan = compiled(name, schedule, ["prompts.prompts_per_step=64"])
    assert_kv_fits(simulate(plan, 2, RooflinePricing(plan)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mean=st.sampled_from([500, 2000, 6000]), sigma=st.sampled_from([0.3, 0.9, 1.4]),
       memory=st.sampled_from([0.5, 0.7, 0.9]), tp=st.sampled_from([4, 8]),
       schedule=st.sampled_from(["sync", "asp"]), colocated=st.booleans())
def test_no_instance_of_a_generated_workload_holds_more_kv_than_fits(mean, sigma, memory, tp, schedule, colocated):
    """dapo_32b's cluster with the length distribution, memory share, instance size and layout drawn."""
    overrides = ["prompts.prompts_per_step=32", "prompts.max_response=30k",
                 f"prompts.response_lengths=lognormal(mean = {mean}, sigma = {sigma}, group_corr = 0.6)",
                 f"gen.gpu_memory_utilization={memory}", f"gen.tp={tp}", f"gen.instances={32 // tp}"]
    path = ROOT / "pipelines" / "dapo_32b.aspl"
    if colocated:  # generation time-shares the learner's 32 devices
        overrides[-1] = f"gen.instances={32 // tp}"
        text = path.read_text().replace("pool rollout = 910b3 x 32\n", "").replace("on rollout {", "on learner {")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "dapo_32b_colocated.aspl"
            path.write_text(text)
            plan = compile_with_passes(path, overrides, schedule).plan()
    else:
        plan = compile_with_passes(path, overrides, schedule).plan()
    assert plan.stages_of("generate")[0].placement == ("time_shared" if colocated else "dedicated")
    assert_kv_fits(simulate(plan, 2, RooflinePricing(plan)))


class LinearCost:
    """A decode step of 1 ms plus 1 µs per token of context; prefill 10 µs a token."""

    alpha = 1e-6

    def beta(self, batch):
        return 1e-3

    def prefill(self, tokens, requests=1, squares=0.0):
        return 1e-5 * tokens


def run_to_the_end(inst, now=0.0):
    """Advance the instance event by event; the samples in the order they finished."""
    finished = []
    while (when := inst.next_event()) is not None:
        now = max(now, when)
        finished += inst.pop_finished(now)
    return finished


def test_a_full_cache_preempts_the_sequence_started_last_and_computes_it_again():
    inst = GenInstance(0, LinearCost(), capacity=4, static=False, devices=1, kv_budget=1000)
    lengths = {(0, 0, 0): 300, (0, 1, 0): 300, (0, 2, 0): 300}  # 3 x (100 prompt + 300) > 1000
    inst.admit(0.0, [Request(s, 100, 0) for s in lengths], lengths.__getitem__)
    finished = run_to_the_end(inst)
    assert sorted(finished) == sorted(lengths)  # none lost, none twice
    assert inst.preemptions >= 1
    assert finished[-1] == (0, 2, 0)  # the one admitted last was preempted and finished last
    assert inst.kv_peak <= 1000
    assert any(category == "preempt" for _, _, category in inst.segments)


def test_requests_that_do_not_fit_wait_inside_the_engine_until_kv_frees():
    inst = GenInstance(0, LinearCost(), capacity=8, static=False, devices=1, kv_budget=800)
    lengths = {(0, p, 0): 50 for p in range(4)}  # 3 x (200 + 50) fit in 800, a fourth prompt does not
    inst.admit(0.0, [Request(s, 200, 0) for s in lengths], lengths.__getitem__)
    assert inst.active == 3 and len(inst.held) == 1
    assert sorted(run_to_the_end(inst)) == sorted(lengths)
    assert inst.preemptions == 0 and inst.kv_peak <= 800


def test_without_a_budget_nothing_waits_and_nothing_is_preempted():
    inst = GenInstance(0, LinearCost(), capacity=4, static=False, devices=1)
    lengths = {(0, p, 0): 300 for p in range(3)}
    inst.admit(0.0, [Request(s, 100, 0) for s in lengths], lengths.__getitem__)
    assert sorted(run_to_the_end(inst)) == sorted(lengths)
    assert inst.preemptions == 0 and not inst.held


def test_prefill_pays_causal_attention_over_its_context():
    """Qwen2.5-32B: 2·N per token against 2·L·H·d·s per token of attention at s = 30k: about 30% more."""
    plan = compiled("dapo_32b", "asp")
    stage = plan.stages_of("generate")[0]
    cost = GenerationCost(plan.model(stage.model).arch, hardware_of(plan, stage), stage.parallel,
                          dtype_bytes("bf16"), True)
    plain = cost.prefill(30_000) - cost.communication(30_000)
    with_attention = cost.prefill(30_000, 1, 30_000 ** 2) - cost.communication(30_000)
    assert with_attention / plain == pytest.approx(1.30, abs=0.03)


@pytest.mark.parametrize("name", ["grpo_7b_colocated", "r1_zero_671b", "agentic_7b"])
def test_an_engine_is_priced_with_the_memory_share_its_launch_gives_it(name):
    """An equal share among the processes on its NPUs (0.45 beside the trainer), or its need when
    more (r1_zero_671b's engine starts alone with 0.62)."""
    plan = compiled(name, "asp")
    stage = plan.stages_of("generate")[0]
    launched = {s.stage: s for s in lower(plan).stages}[stage.name]
    assert engine_memory(plan, stage) == launched.config["gpu_memory_utilization"]


def test_a_colocated_engine_shares_its_devices_memory():
    plan = compiled("grpo_7b_colocated", "asp")
    assert engine_memory(plan, plan.stages_of("generate")[0]) == 0.45
    separate = compiled("grpo_7b", "asp")
    assert engine_memory(separate, separate.stages_of("generate")[0]) == 0.9


def test_a_colocated_engine_holds_less_kv_than_one_with_its_devices_to_itself():
    def budget(name):
        plan = compiled(name, "asp")
        pricing = RooflinePricing(plan)
        stage = plan.stages_of("generate")[0]
        return pricing.generation_instance(stage, stage.instances[0]).kv_budget

    assert math.isfinite(budget("grpo_7b_colocated"))
    assert budget("grpo_7b_colocated") < budget("grpo_7b")
