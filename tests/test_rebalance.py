"""Runtime rebalancing (aspc/controller/rebalance.py): when generation waits at the staleness gate
the controller lends a flexible generation instance to the trainer, and takes it back when the
learner waits for samples — in the simulator and in the local runtime alike."""
import dataclasses

import pytest

from aspc.backends.sim.pricing import RooflinePricing
from aspc.controller.config import ControllerConfig, UnsupportedPlan
from aspc.controller.kinds import refusals
from aspc.controller.rebalance import RebalancePolicy, Rebalancer
from aspc.costmodel.workload import sample_step
from aspc.drivers.sim.driver import Simulation
from aspc.drivers.sim.result import collect
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from test_differential import _DISAGGREGATED, _plan, first_difference, local, recorded, simulated  # noqa: F401

# responses that lengthen over the run (workload drift), on four flexible generation instances
_DRIFT = {**_DISAGGREGATED, "pool rollout = cpu x 2": "pool rollout = cpu x 4", "instances = 2": "instances = 4",
          "lognormal(mean = 8, sigma = 0.6, group_corr = 0.5)": "lognormal(mean = 1.5, sigma = 0.3, growth = 0.3)",
          "stream = 8 }": "stream = 8, rebalance = true }"}

# grpo_7b with short responses that grow 30% a step and long prompts: the learner is the bottleneck
# at first; four tp=2 instances, each one data-parallel rank of the tp=2 trainer
_GRPO_7B_DRIFT = {"mean = 600, sigma = 0.8": "mean = 100, sigma = 0.8, growth = 0.3",
                  "uniform(min = 100, max = 600)": "uniform(min = 1k, max = 2k)",
                  "instances = 2, tp = 4": "instances = 4, tp = 2",
                  "on learner { tp = 4, dp = 2 }": "on learner { tp = 2, dp = 4 }",
                  "tp = 4, dp = 2, loss": "tp = 2, dp = 4, loss"}


def _both(plan, trace) -> tuple[list, list]:
    """The action logs of the simulator and of the local runtime (virtual time)."""
    simulated(plan, trace)
    sim_trace = list(trace)
    trace.clear()
    local(plan, trace)
    return sim_trace, list(trace)


def _moves(trace) -> list[tuple[int, str]]:
    return [(a.instance, a.role) for _, _, actions in trace for a in actions if type(a).__name__ == "MoveInstance"]


def test_sim_and_local_drivers_take_the_same_rebalancing_actions(tmp_path, recorded, monkeypatch):  # noqa: F811
    """Generation waits at the gate while responses are short: an instance is lent to the trainer;
    once they are long the learner waits for samples and the instance comes back (and loads the
    current weights). Both drivers carry out the very same actions at the same instants."""
    import test_differential

    monkeypatch.setattr(test_differential, "STEPS", 14)  # long enough to lend, drift, and take back
    plan = _plan(tmp_path, "drift", "asp", _DRIFT)
    sim_trace, local_trace = _both(plan, recorded)
    assert sim_trace == local_trace, first_difference(sim_trace, local_trace)
    assert _moves(sim_trace) == [(3, "learn"), (3, "gen")]
    returned = next(i for i, (_, event, _) in enumerate(sim_trace) if type(event).__name__ == "InstanceMoved"
                    and event.role == "gen")
    first_actions = sim_trace[returned][2]
    assert any(type(a).__name__ == "SyncWeights" and a.instance == 3 for a in first_actions)
    lent = next(i for i, (_, event, _) in enumerate(sim_trace) if type(event).__name__ == "InstanceMoved")
    dispatches = [i for i, (_, _, actions) in enumerate(sim_trace) for a in actions
                  if type(a).__name__ == "Dispatch" and a.instance == 3]
    assert any(i < lent for i in dispatches) and any(i > returned for i in dispatches)  # it generated,
    assert not [i for i in dispatches if lent <= i <= returned]  # but not while the trainer held it


def _grpo_7b(tmp_path, rebalance: bool):
    text = (ROOT / "pipelines" / "grpo_7b.aspl").read_text()
    for old, new in _GRPO_7B_DRIFT.items():
        assert old in text, old
        text = text.replace(old, new)
    text = text.replace("stream = 16 }", f"stream = 16, rebalance = {'true' if rebalance else 'false'} }}")
    path = tmp_path / "grpo_7b_drift.aspl"
    path.write_text(text)
    return compile_with_passes(path, [], "asp").plan()


def test_rebalancing_raises_simulated_throughput_when_responses_lengthen(tmp_path):
    plan = _grpo_7b(tmp_path, True)
    data = plan.dataset("prompts")
    means = [sum(s.response_len for s in sample_step(data, step)) / data.samples_per_step for step in (0, 7)]
    assert means[1] > 3 * means[0]  # the drift: responses lengthen over the run
    runs = {}
    for on in (False, True):
        sim = Simulation(_grpo_7b(tmp_path, on), 8, RooflinePricing(plan))
        sim.run()
        runs[on] = (sim, collect(sim))
    (off, off_result), (on, on_result) = runs[False], runs[True]
    assert off.moves == [] and [(i, role) for _, i, role in on.moves] == [(3, "learn")]
    assert on_result.wall_s < off_result.wall_s  # the same samples, trained sooner
    assert on_result.samples_per_s > off_result.samples_per_s
    total = sum(on_result.bubbles.values())
    assert total == pytest.approx(on_result.devices * on_result.wall_s)  # lent devices are counted once
    assert on_result.bubbles["sync"] > 0


def _shares(policy, steps: list[tuple[float, float]], rebalancer=None):
    """Feed (learner idle share, generation gate-idle share) per step; the decisions at each boundary."""
    r = rebalancer or Rebalancer(policy)
    decisions = []
    for version, (learner, gate) in enumerate(steps, start=2):
        r.sample_finished(0, (version, 0, 0), 100, False)  # decode steps while the trainer works ...
        r.sample_finished(0, (version, 0, 1), round(100 * learner / (1 - learner)), True)  # ... and while it idles
        r.last_gate = gate
        r.trainer_progress(1, gate)
        decisions.append(r.step_boundary(version, 100))
    return r, decisions


POLICY = RebalancePolicy(flexible=(0, 1, 2, 3), instance_devices=(2, 2, 2, 2), trainer_devices=8)


def test_a_move_needs_the_same_verdict_window_steps_in_a_row():
    _, decisions = _shares(POLICY, [(0.0, 0.6), (0.0, 0.1), (0.0, 0.6), (0.0, 0.6)])
    assert decisions == [None, None, None, ("learn", 3)]


def test_a_move_that_would_only_swap_the_bottleneck_is_not_taken():
    """Generation idles 20% of the learner's time: without a quarter of its devices it would take
    (1 - 0.2) x 4/3 > 1 of it, slower than the learner now is."""
    _, decisions = _shares(POLICY, [(0.0, 0.2)] * 6)
    assert decisions == [None] * 6


def test_a_lent_instance_comes_back_when_the_learner_starves_and_not_before():
    r, decisions = _shares(POLICY, [(0.0, 0.7)] * 2)
    assert decisions[-1] == ("learn", 3)
    r.moved(3, "learn")
    r.new_layout()
    _, later = _shares(POLICY, [(0.1, 0.0), (0.1, 0.0), (0.5, 0.0), (0.5, 0.0)], r)
    assert later == [None, None, None, ("gen", 3)]


def test_rebalance_without_a_flexible_instance_is_refused(tmp_path):
    """Time-shared generation has nothing to lend: said at the generate stage, not ignored."""
    text = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text().replace("stream = 8 }", "stream = 8, rebalance = true }")
    path = tmp_path / "shared.aspl"
    path.write_text(text)
    plan = compile_with_passes(path, [], "asp").plan()
    assert any("rebalance = true" in r.message and r.stage == "gen" for r in refusals(plan))
    with pytest.raises(UnsupportedPlan, match="time-shares its devices"):
        ControllerConfig.from_plan(plan, 2)
    assert not refusals(dataclasses.replace(plan, rebalance=False))


def _tiny(old: str, new: str):
    from aspc.frontend.compiler import compile_source

    text = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    assert old in text
    return compile_source(text.replace(old, new), "x.aspl", base_dir=ROOT / "pipelines")


TINY_LENGTHS = "lognormal(mean = 8, sigma = 0.6, group_corr = 0.5)"


def test_growth_is_a_checked_lognormal_parameter_printed_only_when_written():
    from aspc.frontend.diagnostics import AsplError
    from aspc.ir.printer import print_ir

    with pytest.raises(AsplError, match=r"x.aspl:13:\d+: option 'growth' must be >= 0"):
        _tiny(TINY_LENGTHS, "lognormal(mean = 8, growth = -0.5)")
    assert "growth=0.25" in print_ir(_tiny(TINY_LENGTHS, "lognormal(mean = 8, growth = 0.25)").graph)
    assert "growth" not in print_ir(_tiny(TINY_LENGTHS, TINY_LENGTHS).graph)


def test_rebalance_is_a_checked_schedule_option():
    from aspc.frontend.diagnostics import AsplError

    with pytest.raises(AsplError, match="option 'rebalance' expects true or false"):
        _tiny("stream = 8 }", "stream = 8, rebalance = 2 }")
