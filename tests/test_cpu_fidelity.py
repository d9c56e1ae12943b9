"""The calibrated simulation of a CPU run (issue 15, item 6): shared cores as a resource
(aspc/costmodel/cores.py), the CPU learner's micro-batches, and sub-second tool latencies. Behaviour
on a fake calibration, never timing: the costs below are made up."""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from aspc.accounting.ledger import Ledger
from aspc.backends.sim.pricing import RooflinePricing
from aspc.controller.events import Work
from aspc.costmodel.calibrated import Calibration
from aspc.costmodel.cores import CoreShare, slowdown
from aspc.costmodel.workload import Environment, _draw_seconds, draw_episode
from aspc.drivers.sim.result import simulate
from aspc.frontend.diagnostics import AsplError
from aspc.ir.values import Call
from aspc.cli.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
FAKE = Calibration(decode_fixed=1e-3, decode_per_seq=1e-4, prefill_fixed=1e-3, prefill_per_token=1e-5,
                   forward_fixed=2e-3, forward_per_token=1e-5, train_fixed=4e-3, train_per_token=3e-5,
                   optimizer=2e-3, weight_load=1e-3, cores=2, step_round_trip=1e-4, publish=1e-3, switch=1e-4,
                   score_fixed=1e-3, score_per_token=1e-5, critic_train_fixed=6e-3, critic_train_per_token=5e-5,
                   critic_optimizer=3e-3, forward_per_sample=1e-4, train_per_sample=2e-4, judge_fixed=1e-3,
                   judge_per_sample=2e-3)


# ---- the model: processor sharing ----
def test_slowdown_is_busy_workers_over_cores_and_never_a_speed_up():
    assert slowdown(2, 1) == 2.0
    assert slowdown(3, 2) == 1.5
    assert slowdown(2, 2) == 1.0
    assert slowdown(1, 4) == 1.0
    assert slowdown(0, 2) == 1.0


def test_other_users_processes_take_their_share_beyond_what_the_calibration_saw():
    """One core kept busy by others on two: one worker runs as when calibrated, two share."""
    assert slowdown(1, 2, background=1.0) == 1.0
    assert slowdown(2, 2, background=1.0) == 1.5
    assert slowdown(2, 2, background=0.0) == 1.0


@dataclass
class _Spec:
    name: str


@dataclass
class _Executor:
    spec: _Spec
    busy: list = field(default_factory=list)
    running: bool = False


@dataclass
class _Sim:
    """What CoreShare.settle reads of the simulation: its clock, workers, event heap and ledger."""

    executors: list
    now: float = 0.0
    instances: list = field(default_factory=list)
    heap: list = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)

    def start(self, ex: _Executor, core_seconds: float) -> None:
        """As the driver's _occupy: the end priced in core-seconds, then the driver settles."""
        ex.running = True
        ex.busy.append((self.now, self.now + core_seconds))
        heapq.heappush(self.heap, (self.now + core_seconds, len(self.heap), "executor", (ex, None)))
        self.ledger.span(ex.spec.name, self.now, self.now + core_seconds, "useful", "work", 1)

    def finish_next(self) -> _Executor:
        self.now, _, _, (ex, _) = heapq.heappop(self.heap)
        ex.running = False
        return ex


def _two_workers(cores: int, first: float, second: float) -> tuple[_Sim, CoreShare]:
    a, b = _Executor(_Spec("a")), _Executor(_Spec("b"))
    sim, share = _Sim([a, b]), CoreShare(cores)
    sim.start(a, first)
    sim.start(b, second)
    share.settle(sim)
    return sim, share


def test_two_busy_workers_on_one_core_take_twice_as_long():
    sim, _ = _two_workers(cores=1, first=1.0, second=1.0)
    assert [ex.busy[-1][1] for ex in sim.executors] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert sorted(when for when, *_ in sim.heap) == [pytest.approx(2.0), pytest.approx(2.0)]


def test_two_busy_workers_on_two_cores_do_not_slow_down():
    sim, _ = _two_workers(cores=2, first=1.0, second=1.0)
    assert [ex.busy[-1][1] for ex in sim.executors] == [1.0, 1.0]


def test_a_worker_left_alone_gets_its_core_back():
    """One core: a (1 s of work) and b (3 s) share it until a ends at 2 s; b's last 2 s run alone."""
    sim, share = _two_workers(cores=1, first=1.0, second=3.0)
    assert sim.finish_next().spec.name == "a"
    assert sim.now == pytest.approx(2.0)
    share.settle(sim)
    b = sim.executors[1]
    assert b.busy[-1][1] == pytest.approx(4.0)
    assert sim.ledger.spans[-1].end == pytest.approx(4.0)  # the trace shows the stretched work


# ---- the model in the simulator ----
def _step_time(name: str, schedule: str, calibration: Calibration) -> float:
    plan = compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", schedule=schedule).plan()
    return simulate(plan, 3, RooflinePricing(plan, calibration)).step_time


def test_generation_instances_beyond_the_cores_slow_the_step_down():
    """tiny_grpo generates on two instances at once: on one core they share it, on two or more
    they do not, and more cores than workers buy nothing."""
    one, two, many = (_step_time("tiny_grpo", "sync", replace(FAKE, cores=n)) for n in (1, 2, 16))
    assert one > two
    assert two == pytest.approx(many)


def test_overlapped_generation_and_training_contend_only_beyond_the_cores():
    """tiny_grpo_split under asp overlaps its one instance with the learner."""
    one, two = (_step_time("tiny_grpo_split", "asp", replace(FAKE, cores=n)) for n in (1, 2))
    assert one > two


def test_the_cpu_learner_is_priced_as_it_runs_whatever_the_plans_packing():
    """The CPU learner cuts units by micro_tokens and pads to the longest (remove-padding and
    buckets are plan options it does not implement), so sync-naive and sync train alike."""
    plan = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", schedule="sync").plan()
    naive = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", schedule="sync-naive").plan()
    stage, naive_stage = plan.stages_of("train")[0], naive.stages_of("train")[0]
    work = Work(0, stage.name, "train", 0, ((0, 0, 0), (0, 0, 1)))
    lengths = [20, 30]
    cost = RooflinePricing(plan, FAKE).work(work, stage, lengths)
    assert cost == RooflinePricing(naive, FAKE).work(replace(work, stage=naive_stage.name), naive_stage, lengths)
    assert cost.seconds == pytest.approx(FAKE.train_fixed + FAKE.train_per_sample * 2 + FAKE.train_per_token * 2 * 30)
    assert cost.padding > 0  # the shorter sequence's pad tokens


def test_a_cpu_judge_costs_per_sample_and_decodes_no_verdict():
    plan = compile_with_passes(ROOT / "pipelines" / "tiny_rlaif.aspl", schedule="sync").plan()
    stage = next(s for s in plan.stages if s.kind == "reward")
    pricing = RooflinePricing(plan, FAKE)
    cost = pricing.judge(stage, "grader", "", [20] * 8)
    assert cost.seconds == pytest.approx(FAKE.judge_fixed + 8 * FAKE.judge_per_sample)


def test_a_critic_makes_training_dearer():
    plan = compile_with_passes(ROOT / "pipelines" / "tiny_ppo.aspl", schedule="sync").plan()
    assert RooflinePricing(plan, FAKE).optimizer() == FAKE.critic_optimizer


# ---- tool latencies below a second ----
def _agentic(tmp_path: Path, latency: str):
    text = (ROOT / "pipelines" / "tiny_agentic.aspl").read_text()
    start = text.index("latency = ")
    end = text.index(")", start) + 1
    path = tmp_path / "agentic.aspl"
    path.write_text(text[:start] + f"latency = {latency}" + text[end:])
    (tmp_path / "tiny_tools.py").write_text((ROOT / "pipelines" / "tiny_tools.py").read_text())
    return compile_with_passes(path, schedule="sync").plan()


def test_a_tool_may_answer_in_milliseconds(tmp_path):
    plan = _agentic(tmp_path, "seconds(0.006)")
    env = Environment.of(dict(plan.stages_of("environment")[0].options))
    data = plan.dataset(plan.stages_of("generate")[0].data)
    draws = [draw_episode(env, data, 0, p, 0, 14) for p in range(8)]
    assert {s for d in draws for s in d.latencies} == {0.006}
    assert any(d.latencies for d in draws)


def test_seconds_without_a_spread_draws_no_random_number():
    """So a pipeline that switches to seconds(...) keeps every other draw as it was."""
    rng, untouched = random.Random(3), random.Random(3)
    assert _draw_seconds(Call("seconds", (("mean", 0.25), ("sigma", 0.0))), rng) == 0.25
    assert rng.random() == untouched.random()


def test_whole_second_latencies_draw_as_before():
    assert _draw_seconds(Call("fixed", (("length", 1),)), random.Random(0)) == 1.0


def test_a_latency_must_be_positive(tmp_path):
    with pytest.raises(AsplError, match="must be > 0"):
        _agentic(tmp_path, "seconds(0)")


# ---- the workload the benchmark simulates ----
def test_policy_lengths_are_what_the_generator_writes():
    from aspc.backends.cpu.calibrate import policy_lengths
    from aspc.backends.cpu.generator import BatchGenerator
    from aspc.backends.cpu.model import TinyQwen

    plan = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", schedule="sync").plan()
    model = TinyQwen(plan.model("actor").arch, seed=0).eval()
    engine = BatchGenerator(model, 4, max_tokens=6, temperature=1.0)
    lengths = policy_lengths(engine, [([1, 5, 6, 7], seed) for seed in range(6)])
    assert len(lengths) == 6
    assert all(1 <= n <= 6 for n in lengths)
