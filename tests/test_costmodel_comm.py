"""Communication in the cost model (issue 15, item 2): TP all-reduce and expert all-to-all in
generation, pipeline fill/drain in training, weight sync as the real systems do it, and the A3
(910C) hardware entry."""
import dataclasses

import pytest

from aspc.backends.sim.pricing import RooflinePricing
from aspc.costmodel.learner import WorkCost, work_cost
from aspc.costmodel.roofline import (GenerationCost, LearnerCost, broadcast_seconds, parameters,
                                     reshard_seconds)
from aspc.ir.facts import hardware_table, model_presets
from aspc.ir.graph import Parallel
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT

BF16 = 2


def generation(model="qwen2.5-7b", hw="910b3", **parallel) -> GenerationCost:
    return GenerationCost(model_presets()[model], hardware_table()[hw], Parallel(**parallel), BF16, True)


def plan_of(name, overrides=()):
    return compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", list(overrides), "asp").plan()


def ring_all_reduce(nbytes, group, gbps, latency):
    eff = parameters()["communication"]["bandwidth_efficiency"]
    return latency + 2 * (group - 1) / group * nbytes / (eff * gbps * 1e9)


# ---- TP all-reduce ----
def test_no_tensor_parallelism_no_all_reduce():
    assert generation(tp=1).tp_all_reduce(64) == 0.0


def test_tp_all_reduce_grows_with_batch():
    cost = generation(tp=4)
    assert cost.tp_all_reduce(1) < cost.tp_all_reduce(64) < cost.tp_all_reduce(256)
    assert cost.communication(256) == cost.tp_all_reduce(256)  # a dense model: no all-to-all


def test_tp_all_reduce_grows_with_tp_on_a_switched_link():
    """On NVSwitch (or 910C's UB) every peer gets the full link, so the ring's 2(n-1)/n decides."""
    times = [generation(hw="h100", tp=tp).tp_all_reduce(128) for tp in (2, 4, 8)]
    assert times[0] < times[1] < times[2]


def test_tp_all_reduce_on_the_910b_mesh_uses_only_the_groups_links():
    """HCCS is a full mesh of 7 links: a tp=2 pair shares one 28 GB/s link (FACTS: 18 GB/s measured)."""
    arch, c = model_presets()["qwen2.5-7b"], parameters()["communication"]
    nbytes = 128 * arch.hidden * BF16
    expected = 2 * arch.layers * ring_all_reduce(nbytes, 2, 196 / 7, c["link_latency_s"])
    assert generation(tp=2).tp_all_reduce(128) == pytest.approx(expected)


def test_tp_beyond_a_node_crosses_the_network():
    arch, c = model_presets()["qwen2.5-7b"], parameters()["communication"]
    hw = hardware_table()["910b3"]
    nbytes = 128 * arch.hidden * BF16
    expected = 2 * arch.layers * ring_all_reduce(nbytes, 16, hw.network_gbps, c["network_latency_s"])
    assert generation(tp=16).tp_all_reduce(128) == pytest.approx(expected)
    assert generation(tp=16).tp_all_reduce(128) > generation(tp=8).tp_all_reduce(128)


def test_prefill_pays_the_all_reduce_of_its_tokens():
    cost = generation(tp=4)
    compute = 2 * model_presets()["qwen2.5-7b"].active_params() * 4096 / (
        parameters()["efficiency"]["flops"] * hardware_table()["910b3"].peak_bf16_tflops * 1e12 * 4)
    assert cost.prefill(4096) == pytest.approx(compute + cost.tp_all_reduce(4096))


# ---- MoE expert all-to-all ----
def test_expert_all_to_all_is_there_iff_ep_above_one():
    assert generation("qwen3-30b-a3b", tp=4, ep=1).expert_all_to_all(256) == 0.0
    assert generation("qwen3-30b-a3b", tp=4, ep=4).expert_all_to_all(256) > 0.0
    assert generation("qwen2.5-7b", tp=4, ep=4).expert_all_to_all(256) == 0.0  # dense: no experts


def test_expert_all_to_all_is_paid_in_decode_and_prefill():
    with_ep, without = generation("qwen3-30b-a3b", tp=4, ep=4), generation("qwen3-30b-a3b", tp=4, ep=1)
    assert with_ep.prefill(2048) - without.prefill(2048) == pytest.approx(with_ep.expert_all_to_all(2048))
    assert with_ep.communication(64) == pytest.approx(with_ep.tp_all_reduce(64) + with_ep.expert_all_to_all(64))


def test_an_ep_group_beyond_a_node_uses_the_network():
    inside = generation("deepseek-v3", tp=2, dp=4, ep=8).expert_all_to_all(1024)
    across = generation("deepseek-v3", tp=2, dp=32, ep=64).expert_all_to_all(8 * 1024)  # same tokens a device
    assert across > inside


# ---- pipeline fill/drain ----
def _train_stage(pp: int):
    stage = plan_of("grpo_7b").stage("update")
    return dataclasses.replace(stage, parallel=dataclasses.replace(stage.parallel, pp=pp, dp=2))


def _work(pp: int) -> tuple[WorkCost, float]:
    stage = _train_stage(pp)
    cost = LearnerCost(model_presets()["qwen2.5-7b"], hardware_table()["910b3"], stage.parallel, False)
    batch = (8000, 8000, 8000 * 1000, 8000 * 1000)
    ranks = [[batch] * 4, [batch] * 4]  # even ranks: no rank skew
    return work_cost(stage, cost, "train", ranks), 4 * cost.train(8000, 8000 * 1000)


def test_no_pipeline_no_fill_drain():
    work, busy = _work(pp=1)
    assert work.skewness == 0.0
    assert work.seconds == pytest.approx(busy)


def test_pipeline_fill_drain_is_skewness_not_useful():
    work, busy = _work(pp=2)
    devices = 4 * 2  # tp x pp of one rank
    fill = busy * (2 - 1) / 4  # (pp - 1) / micro-batches
    assert work.seconds == pytest.approx(busy + fill)
    assert work.skewness == pytest.approx(2 * fill * devices)
    assert work.useful == pytest.approx(2 * busy * devices)
    assert work.useful + work.padding + work.skewness == pytest.approx(work.seconds * devices * 2)


# ---- weight sync ----
def test_a_broadcast_gets_no_faster_with_more_receivers():
    nbytes = 15e9
    times = [broadcast_seconds(nbytes, receivers, 25) for receivers in (4, 16, 64, 256)]
    assert times == sorted(times)
    assert times[0] >= nbytes / (parameters()["transfer"]["weight_sync_gbps"] * 1e9)


def test_a_disaggregated_load_gets_no_faster_with_more_generation_devices():
    def load(instances):
        plan = plan_of("grpo_7b", [f"rollout.count={4 * instances}", f"gen.instances={instances}"])
        return RooflinePricing(plan).load(4, False)

    small, large = load(1), load(4)
    pricing = RooflinePricing(plan_of("grpo_7b"))
    assert pricing.load(16, False) == pricing.load(4, False)  # not a per-device rate times devices
    assert large >= small
    weights = model_presets()["qwen2.5-7b"].total_params() * BF16
    assert small >= weights / (parameters()["transfer"]["weight_sync_gbps"] * 1e9)


def test_the_trainer_publish_does_not_depend_on_the_receivers():
    pricing = RooflinePricing(plan_of("grpo_7b"))
    assert pricing.publish(8, False) == pricing.publish(64, False) > 0
    assert pricing.publish(8, True) == 0.0


def test_a_colocated_load_onloads_the_tp_shard_once_divided():
    """The old load divided the weights by tp and then by the instance's devices (tp again)."""
    plan = plan_of("grpo_7b_colocated")
    assert plan.weight_syncs[0].transfer == "offload_onload"
    gen, train = plan.stage("gen"), plan.stage("update")
    arch, hw = model_presets()["qwen2.5-7b"], hardware_table()["910b3"]
    shard = arch.total_params() * BF16 / gen.parallel.tp
    onload = shard / (parameters()["transfer"]["offload_gbps"] * 1e9)
    resharding = reshard_seconds(arch, train.parallel, gen.parallel, hw, BF16)
    assert RooflinePricing(plan).load(gen.parallel.tp, False) == pytest.approx(resharding + onload)
    assert resharding > 0  # an all-gather over the training TP group


def test_resharding_pays_the_pipeline_stage_broadcast_and_the_expert_moves():
    arch, hw = model_presets()["deepseek-v3"], hardware_table()["910b3"]
    gen = Parallel(tp=2, dp=32, ep=64)
    flat = reshard_seconds(arch, Parallel(tp=4, dp=96, ep=64), gen, hw, BF16)
    staged = reshard_seconds(arch, Parallel(tp=4, pp=6, dp=16, ep=64), gen, hw, BF16)
    moved = reshard_seconds(arch, Parallel(tp=4, pp=6, dp=16, ep=16), gen, hw, BF16)
    assert flat < staged < moved


# ---- the A3 entry ----
def test_the_910c_entry_loads_with_its_supernode():
    hw = hardware_table()["910c"]
    assert (hw.peak_bf16_tflops, hw.hbm_tbps, hw.link_gbps, hw.network_gbps) == (752, 3.2, 392, 50)
    assert hw.hbm_bytes == pytest.approx(128e9, rel=0.01)
    assert hw.group_gbps(384) == hw.link_gbps  # the UB spans the supernode
    assert hw.group_gbps(385) == hw.network_gbps
    assert hw.ray_resource == "NPU"


def test_every_entry_says_how_devices_connect():
    for hw in hardware_table().values():
        assert hw.scale_up_devices >= 1 and hw.network_gbps > 0 and hw.link_gbps > 0
        assert hw.mesh_links == 0 or hw.mesh_links == hw.scale_up_devices - 1
