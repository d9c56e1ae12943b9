"""The simulator predicts the runtime: the same plan through the sim driver and the local
driver (its threads on virtual time), both over executors of known, deterministic durations
(tests/timed_fakes.py), makes the controller see the same events at the same instants and take
the same actions — the same dispatches, the same order of unit completions, the same weight
versions, the same pool switches. So every scheduling decision is the controller's, and neither
driver adds, drops, delays or reorders one."""
import pytest

from aspc.controller.core import Controller
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.drivers.local.virtual_time import VirtualTime
from aspc.drivers.sim.driver import Simulation
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from timed_fakes import FakeExecutors, FakePricing

STEPS = 4

_DISAGGREGATED = {"pool cpu = cpu x 2": "pool rollout = cpu x 2\npool learner = cpu x 1",
                  "generate(actor, prompts) on cpu": "generate(actor, prompts) on rollout",
                  "reference(ref, gen) on cpu": "reference(ref, gen) on learner",
                  "adv) on cpu": "adv) on learner"}
_REWARD_MODEL = {**_DISAGGREGATED,
                 "pool learner = cpu x 1": "pool learner = cpu x 1\npool judges = cpu x 2",
                 "model ref = frozen(actor)": "model ref = frozen(actor)\nmodel rm = frozen(actor)",
                 'reward(gen, rule = "exact_match")': "reward(gen, model = rm) on judges { instances = 2 }"}
_JUDGE = {**_REWARD_MODEL, "reward(gen, model = rm) on judges": 'reward(gen, sources = [judge(model = rm, prompt = '
                                                                 '"grade it"), rule("exact_match", weight = 0.2)]) '
                                                                 "on judges"}
_REWARD_ON_LEARNER = {**_DISAGGREGATED,  # the reward model time-shares the trainer's executor
                      "model ref = frozen(actor)": "model ref = frozen(actor)\nmodel rm = frozen(actor)",
                      'reward(gen, rule = "exact_match")': "reward(gen, model = rm) on learner"}
_REFERENCE_ON_ROLLOUT = {**_DISAGGREGATED,  # the reference time-shares the generation pool
                         "reference(ref, gen) on learner": "reference(ref, gen) on rollout"}
_CONTENDED = {**_DISAGGREGATED, "tool_workers = 4": "tool_workers = 1",  # one runner; syncs at
              "stream = 8 }": "stream = 8, partial_rollout = 2 }"}  # turn boundaries
_TIMEOUTS = {"timeout = 5": "timeout = 0.5"}  # every call runs past its timeout: episodes end on it
_FILTERED = {"micro_tokens = 1k\n}": "micro_tokens = 1k, filter_groups = true\n}"}  # dynamic sampling
_CARRIED = {"stream = 8 }": "stream = 8, partial_rollout = 1 }"}  # a time-shared pool's phases end at their tail
_MINI_BATCHED = {"micro_tokens = 1k\n}": "micro_tokens = 1k, mini_batches = 2\n}"}  # two optimizer steps a phase
PLANS = {"time_shared": {}, "time_shared_carried": _CARRIED, "mini_batched": _MINI_BATCHED,
         "disaggregated": _DISAGGREGATED, "reward_model": _REWARD_MODEL, "judge": _JUDGE,
         "reward_on_learner": _REWARD_ON_LEARNER, "reference_on_rollout": _REFERENCE_ON_ROLLOUT,
         "agentic": {}, "agentic_contended": _CONTENDED,
         "agentic_timeouts": _TIMEOUTS, "filtered": _FILTERED,
         "filtered_disaggregated": {**_DISAGGREGATED, **_FILTERED}, "ppo_whitened_over_the_step": {}}
BASES = {"agentic": "tiny_agentic", "agentic_contended": "tiny_agentic", "agentic_timeouts": "tiny_agentic",
         "ppo_whitened_over_the_step": "tiny_ppo"}


def _plan(tmp_path, name: str, schedule: str, replacements: dict | None = None):
    base = BASES.get(name, "tiny_grpo")
    text = (ROOT / "pipelines" / f"{base}.aspl").read_text()
    for old, new in (replacements or PLANS[name]).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.aspl"
    path.write_text(text)
    (tmp_path / "tiny_tools.py").write_text((ROOT / "pipelines" / "tiny_tools.py").read_text())
    return compile_with_passes(path, [], schedule).plan()


class Trace(list):
    """Every (instant, event, actions) the controller handles, in order; `now` reads the clock of
    the driver that runs."""

    now = None


@pytest.fixture
def recorded(monkeypatch):
    trace = Trace()
    handle = Controller.handle

    def recording(self, event):
        actions = handle(self, event)
        trace.append((trace.now(), event, tuple(actions)))
        return actions

    monkeypatch.setattr(Controller, "handle", recording)
    return trace


def simulated(plan, trace: Trace):
    sim = Simulation(plan, STEPS, FakePricing(plan))
    trace.now = lambda: sim.now
    sim.run()
    return sim


def local(plan, trace: Trace):
    clock = VirtualTime()
    trace.now = clock
    runtime = LocalRuntime(plan, None, RunOptions(steps=STEPS, warmstart_steps=0),
                           lambda plan, base_dir, seed: FakeExecutors(clock, plan), clock=clock)
    runtime.build()
    runtime.run()
    return runtime


def both(plan, recorded) -> tuple[list, list]:
    simulated(plan, recorded)
    sim_trace = list(recorded)
    recorded.clear()
    local(plan, recorded)
    return sim_trace, list(recorded)


def first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i}:\n  sim:   {x}\n  local: {y}"
    return f"lengths differ: sim {len(a)}, local {len(b)} events"


@pytest.mark.parametrize("schedule", ["asp", "sync"])
@pytest.mark.parametrize("name", list(PLANS))
def test_sim_and_local_drivers_take_the_same_actions(tmp_path, recorded, name, schedule):
    plan = _plan(tmp_path, name, schedule)
    sim_trace, local_trace = both(plan, recorded)
    assert sim_trace == local_trace, first_difference(sim_trace, local_trace)
    kinds = {type(a).__name__ for _, _, actions in sim_trace for a in actions}
    assert {"Dispatch", "RunWork", "OptimizerStep", "PublishWeights", "SyncWeights", "Finished"} <= kinds
    if name in ("time_shared", "time_shared_carried", "reference_on_rollout"):
        assert "SwitchPool" in kinds
    if name == "time_shared_carried" and schedule == "asp":  # requests in flight went on after the learner's turn
        assert any(type(a).__name__ == "SyncWeights" and a.interrupt for _, _, actions in sim_trace for a in actions)
    if name in ("reward_model", "judge") and schedule == "asp":  # streamed units: both judges instances score them
        executors = {a.executor for _, _, actions in sim_trace for a in actions
                     if type(a).__name__ == "RunWork" and a.work.kind == "reward"}
        assert len(executors) == 2
    if name.startswith("agentic"):  # tool calls are the controller's: queued for runners, resumed on instances
        assert {"RunTool", "ResumeEpisode"} <= kinds
    if name == "agentic_contended" and schedule == "asp":  # syncs wait for turn boundaries, then interrupt
        assert any(type(a).__name__ == "SyncWeights" and a.interrupt for _, _, actions in sim_trace for a in actions)
    if name.startswith("filtered"):  # all-equal groups replaced by more prompts of the same step
        prompts = plan.dataset(plan.stages_of("generate")[0].data).prompts_per_step
        assert any(r.sample[1] >= prompts for _, _, actions in sim_trace for a in actions
                   if type(a).__name__ == "Dispatch" for r in a.requests)
    if name == "reward_on_learner":  # scoring and training serialize on the trainer's executor
        runs = {a.work.kind: a.executor for _, _, actions in sim_trace for a in actions
                if type(a).__name__ == "RunWork"}
        assert runs["reward"] == runs["train"]


def test_both_drivers_move_episodes_alike(tmp_path, recorded, monkeypatch):
    """Moving an episode off the instance that holds its KV prefix (detach there, prefill its
    history here) is carried out alike: with a controller that moves every episode it can, the
    traces still match."""
    from aspc.controller.generation import Generation

    def restless(self, sample, home, context):
        loaded = self.instances[home].loaded
        peers = [j for j, other in enumerate(self.instances) if j != home and other.loaded == loaded
                 and other.pending_sync is None and len(other.inflight) < other.capacity]
        return peers[0] if peers else home

    monkeypatch.setattr(Generation, "resume_target", restless)
    small = {**_CONTENDED, "prompts_per_step = 16": "prompts_per_step = 2"}  # free slots to move to
    plan = _plan(tmp_path, "agentic_contended", "asp", small)
    sim_trace, local_trace = both(plan, recorded)
    assert sim_trace == local_trace, first_difference(sim_trace, local_trace)
    moved = [a for _, _, actions in sim_trace for a in actions if type(a).__name__ == "ResumeEpisode"
             and a.instance != a.home]
    assert len(moved) >= 3


def test_a_driver_that_deviates_is_caught(tmp_path, recorded, monkeypatch):
    """The comparison has teeth: a local driver whose weight loads take a sixteenth of a second
    longer than the simulator prices them no longer matches it."""
    import timed_fakes

    plan = _plan(tmp_path, "disaggregated", "asp")
    simulated(plan, recorded)
    sim_trace = list(recorded)
    recorded.clear()
    monkeypatch.setattr(timed_fakes.FakeEngine, "load_weights",
                        lambda self, state: self.time.sleep(timed_fakes.LOAD + 2 ** -4))
    local(plan, recorded)
    assert sim_trace != list(recorded)


def test_a_reward_model_on_its_own_pool_scores_groups_while_generation_goes_on(tmp_path, recorded):
    """Score-as-finished: each group is scored as soon as it completes, on the judges' devices,
    while the generation instances still have requests in flight."""
    plan = _plan(tmp_path, "reward_model", "asp")
    simulated(plan, recorded)
    group = plan.dataset(plan.stages_of("generate")[0].data).group
    scorings = [(t, a.work) for t, _, actions in recorded for a in actions
                if type(a).__name__ == "RunWork" and a.work.kind == "reward"]
    assert scorings and all(len(work.samples) == group for _, work in scorings)
    finishes = [t for t, event, _ in recorded if type(event).__name__ == "SamplesFinished"]
    overlapped = [t for t, _ in scorings if any(f > t for f in finishes if f < t + 10)]
    assert len(overlapped) > len(scorings) // 2  # most scorings start while samples still finish
