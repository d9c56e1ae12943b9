"""The learner's costs beside its passes (issue 34, item 1): each streamed unit waits for its
dispatch (booked as sorting), the trainer's data-parallel gradient reduction once a step over the
link its group spans, and a weight broadcast on the network meanwhile slowing that reduction."""
import functools

import pytest

from aspc.backends.sim.pricing import RooflinePricing
from aspc.cli.toolchain import compile_with_passes
from aspc.costmodel.learner import packed_ranks, work_cost
from aspc.costmodel.roofline import LearnerCost, hardware_of, parameters
from aspc.drivers.sim.result import simulate
from aspc.ir.facts import model_presets
from aspc.ir.graph import Parallel
from conftest import ROOT

QWEN_32B = model_presets()["qwen2.5-32b"]


@functools.cache
def plan_of(name: str, schedule: str = "asp"):
    return compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", ["prompts.prompts_per_step=32"], schedule).plan()


def dapo_hardware():
    plan = plan_of("dapo_32b")
    return hardware_of(plan, plan.stages_of("train")[0])


def reduction(par: Parallel, shared: float = 0.0) -> float:
    return LearnerCost(QWEN_32B, dapo_hardware(), par, True).gradient_reduction(shared)


def test_the_gradient_reduction_crosses_the_link_its_data_parallel_group_spans():
    """dp 1: nothing to reduce. tp 2 x dp 4 spans 8 devices (one 910B3 node): the scale-up link;
    tp 8 x cp 2 x dp 4 spans 64: the network, slower. The bytes: an all-reduce of the rank's share."""
    assert reduction(Parallel(tp=8, pp=2, dp=1)) == 0.0
    inside, across = reduction(Parallel(tp=2, dp=4)), reduction(Parallel(tp=8, dp=4, cp=2))
    assert 0.0 < inside and 0.0 < across
    c, hw = parameters()["communication"], dapo_hardware()
    local = QWEN_32B.total_params() / 8 * 2  # bf16 gradients of a tp-8 rank
    moved = 2 * 7 / 8 * local  # over the 8 dp x cp ranks
    assert across == pytest.approx(c["network_latency_s"] + moved / (c["bandwidth_efficiency"] * hw.network_gbps * 1e9))
    assert reduction(Parallel(tp=2, dp=4, cp=1), shared=5.0) == inside  # a broadcast does not cross the node's link


def test_a_broadcast_on_the_network_slows_the_reduction_that_crosses_it():
    par = Parallel(tp=8, dp=4, cp=2)
    assert reduction(par, shared=5.3) > reduction(par)


def test_the_trainer_step_pays_the_broadcast_only_on_separate_pools():
    separate, colocated = plan_of("dapo_32b"), plan_of("grpo_7b_colocated")
    pricing = RooflinePricing(separate)
    assert pricing.optimizer(loading=True) > pricing.optimizer(loading=False)
    shared = RooflinePricing(colocated)
    assert shared.optimizer(loading=True) == shared.optimizer(loading=False)


class LongLoads(RooflinePricing):
    """Weight loads that outlast every step, so that each optimizer step runs during one."""

    def load(self, devices: int, interrupt: bool) -> float:
        return 1e5


def test_the_simulator_prices_an_optimizer_step_during_a_load_with_the_network_shared():
    plan = plan_of("dapo_32b")
    pricing = LongLoads(plan)
    alone, shared = pricing.optimizer(False), pricing.optimizer(True)
    steps = [s.end - s.start for s in simulate(plan, 3, pricing).spans if s.label.startswith("optimizer")]
    assert steps[0] == pytest.approx(alone)  # before the first publish: nothing loads
    assert steps[1] == pytest.approx(shared)  # step 1 trains (asp, staleness 1) while version 1 loads
    assert all(s == pytest.approx(alone) or s == pytest.approx(shared) for s in steps)
    quick = [s.end - s.start for s in simulate(plan, 3, RooflinePricing(plan)).spans if s.label.startswith("optimizer")]
    assert all(s == pytest.approx(alone) for s in quick)  # loads of ~13 s end long before a step's last unit


def test_each_learner_unit_waits_for_its_dispatch_booked_as_sorting():
    plan = plan_of("dapo_32b")
    pricing = RooflinePricing(plan)
    train = plan.stages_of("train")[0]
    work = type("Work", (), {"step": 0, "samples": [(0, i) for i in range(16)], "kind": "train"})()
    lengths = [1000 + 37 * i for i in range(16)]
    priced = pricing.work(work, train, lengths)  # the train stage has its micro-batch shape: priced as it is
    bare = work_cost(train, pricing._learner_cost(train), "train", packed_ranks(train, lengths, pricing.mean_tokens))
    wait = parameters()["learner"]["unit_dispatch_s"]
    assert priced.seconds == pytest.approx(bare.seconds + wait)
    devices = train.parallel.tp * train.parallel.pp * train.parallel.cp * train.parallel.dp
    assert priced.dispatch == pytest.approx(wait * devices) and priced.useful == pytest.approx(bare.useful)
