"""The controller's half of agentic episodes (aspc/controller/core.py, tools.py): tool calls queue
for a bounded set of runners, an episode goes on where its KV prefix is unless moving it shortens
the longest queue, weight syncs under partial rollout wait for turn boundaries, and under random
completion orders every episode is trained once within the staleness bound."""
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from aspc.controller import Controller, ControllerConfig
from aspc.controller.events import (Dispatch, InstanceIdle, OptimizerDone, OptimizerStep, PublishWeights,
                                    ResumeEpisode, RunTool, RunWork, SampleFinished, Start, SyncWeights, ToolCalled,
                                    ToolReturned, WeightsLoaded, WeightsPublished, WorkFinished)
from test_controller import executors


def config(**changes) -> ControllerConfig:
    base = dict(steps=2, prompts_per_step=2, group=2, instances=2, staleness=1, policy="queue_aware",
                group_affinity=False, stream_micro=None, partial_rollout=0, forward_stages=(), train_stage="update",
                max_response=64, executors=executors((), False), gen_pool="gpus", tool_workers=1)
    return ControllerConfig(**{**base, **changes})


def started(c: ControllerConfig, capacity: int = 4) -> tuple[Controller, dict]:
    """A controller after start-up; the samples each instance was given."""
    ctl = Controller(c, lambda step, prompt: 8)
    ctl.handle(Start())
    given_to = {}
    for i in range(c.instances):
        for a in ctl.handle(InstanceIdle(i, capacity)):
            if isinstance(a, Dispatch):
                given_to.update({r.sample: a.instance for r in a.requests})
    return ctl, given_to


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_tool_calls_wait_for_a_free_runner_in_order():
    ctl, given_to = started(config(tool_workers=1))
    first, second = sorted(given_to)[:2]
    assert of(ctl.handle(ToolCalled(first, given_to[first], 20, 1, 10)), RunTool) == [RunTool(first, 0)]
    assert of(ctl.handle(ToolCalled(second, given_to[second], 20, 1, 10)), RunTool) == []  # the runner is busy
    actions = ctl.handle(ToolReturned(first, 0, "ok"))
    assert of(actions, RunTool) == [RunTool(second, 0)]
    assert of(actions, ResumeEpisode) == [ResumeEpisode(first, given_to[first], given_to[first])]  # sticky


def test_a_timed_out_call_ends_the_episode_where_it_is():
    ctl, given_to = started(config(tool_workers=2))
    sample = sorted(given_to)[0]
    ctl.handle(ToolCalled(sample, given_to[sample], 20, 1, 10))
    home = given_to[sample]
    assert of(ctl.handle(ToolReturned(sample, 0, "timeout")), ResumeEpisode) == [ResumeEpisode(sample, home, home)]


def _loaded(policy: str):
    """Instance 0 is full of episodes waiting on tools with a request queued behind them; instance 1
    has finished its work and has free slots and no queue."""
    ctl, given_to = started(config(policy=policy, tool_workers=4, prompts_per_step=3, group=2, group_affinity=True,
                                   staleness=0),
                            capacity=4)
    on_zero = [s for s, i in given_to.items() if i == 0]
    for s in [s for s, i in given_to.items() if i == 1]:
        ctl.handle(SampleFinished(s, 1, 4))  # short answers: the history predicts short episodes
    for s in on_zero:
        ctl.handle(ToolCalled(s, 0, 12, 1, 4))
    ctl.gen.instances[0].push([((1, 0, 0), 8, 500.0)])  # and a request queued behind them, waiting for a slot
    return ctl, on_zero


def test_queue_aware_dispatch_moves_an_episode_off_a_loaded_instance():
    ctl, on_zero = _loaded("queue_aware")
    resumed = of(ctl.handle(ToolReturned(on_zero[0], 0, "ok")), ResumeEpisode)
    assert resumed == [ResumeEpisode(on_zero[0], 1, 0)]
    assert ctl.gen.inflight[on_zero[0]] == 1 and on_zero[0] not in ctl.gen.instances[0].inflight


def test_round_robin_dispatch_keeps_episodes_where_their_kv_is():
    ctl, on_zero = _loaded("round_robin")
    assert of(ctl.handle(ToolReturned(on_zero[0], 0, "ok")), ResumeEpisode) == [ResumeEpisode(on_zero[0], 0, 0)]


def test_an_episode_stays_when_its_slot_holds_nothing_back():
    """Without requests queued behind the home instance, moving would only add a prefill."""
    ctl, on_zero = _loaded("queue_aware")
    ctl.gen.instances[0].remove(0)
    assert of(ctl.handle(ToolReturned(on_zero[0], 0, "ok")), ResumeEpisode) == [ResumeEpisode(on_zero[0], 0, 0)]


def test_partial_rollout_syncs_an_instance_at_a_turn_boundary():
    """A pending weight sync waits while a turn is under way, loads once every episode waits on a
    tool, and resumes episodes whose tool answered meanwhile only after the load."""
    ctl, given_to = started(config(instances=1, partial_rollout=1, tool_workers=4, steps=3, staleness=2), capacity=2)
    a, b = sorted(given_to)[:2]
    ctl.handle(ToolCalled(a, 0, 20, 1, 10))
    ctl.gen.instances[0].pending_sync = 1  # the learner published version 1
    assert ctl._sync_if_ready(0) == []  # b is inside a turn
    assert of(ctl.handle(ToolReturned(a, 0, "ok")), ResumeEpisode) == []  # held back for the sync
    syncs = of(ctl.handle(ToolCalled(b, 0, 20, 1, 10)), SyncWeights)
    assert syncs == [SyncWeights(0, 1, True)]  # both between turns: load now
    assert of(ctl.handle(WeightsLoaded(0, 1)), ResumeEpisode) == [ResumeEpisode(a, 0, 0)]
    assert ctl.gen.start_version[a] == 0  # the episode's version is its first turn's


class EpisodeDriver:
    """Completes actions in a random order; each sample makes 0-2 tool calls, some fail."""

    def __init__(self, c: ControllerConfig, seed: int):
        self.rng, self.config = random.Random(seed), c
        self.controller = Controller(c, lambda step, prompt: 8)
        self.events, self.trained, self.calls_left = [], Counter(), {}
        self.running_tools = 0
        self.peak_tools = 0

    def turn_ends(self, sample, instance):
        if self.calls_left[sample] > 0:
            self.calls_left[sample] -= 1
            return ToolCalled(sample, instance, 30, 1, 10)
        return SampleFinished(sample, instance, self.rng.randint(1, 64), 2)

    def act(self, actions):
        for a in actions:
            if isinstance(a, Dispatch):
                for r in a.requests:
                    self.calls_left[r.sample] = self.rng.randint(0, 2)
                    self.events.append(self.turn_ends(r.sample, a.instance))
            elif isinstance(a, RunTool):
                self.running_tools += 1
                self.peak_tools = max(self.peak_tools, self.running_tools)
                self.events.append(ToolReturned(a.sample, a.runner, self.rng.choice(["ok", "ok", "error", "timeout"])))
            elif isinstance(a, ResumeEpisode):
                ended = self.last_status[a.sample] == "timeout"
                self.events.append(SampleFinished(a.sample, a.home, 5, 2) if ended
                                   else self.turn_ends(a.sample, a.instance))
            elif isinstance(a, RunWork):
                self.events.append(WorkFinished(a.work.id))
                self.trained.update(a.work.samples if a.work.kind == "train" else ())
            elif isinstance(a, OptimizerStep):
                self.events.append(OptimizerDone(a.step))
            elif isinstance(a, PublishWeights):
                self.events.append(WeightsPublished(a.version))
            elif isinstance(a, SyncWeights):
                self.events.append(WeightsLoaded(a.instance, a.version))

    def run(self):
        self.last_status = {}
        self.act(self.controller.handle(Start()))
        for i in range(self.config.instances):
            self.act(self.controller.handle(InstanceIdle(i, self.rng.randint(1, 4))))
        while not self.controller.finished:
            assert self.events, "deadlock: the controller waits for nothing"
            event = self.events.pop(self.rng.randrange(len(self.events)))
            if isinstance(event, ToolReturned):
                self.running_tools -= 1
                self.last_status[event.sample] = event.status
            self.act(self.controller.handle(event))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2),
       st.sampled_from(["queue_aware", "round_robin"]), st.integers(0, 10**6))
def test_every_episode_is_trained_once_within_the_staleness_bound(instances, workers, staleness, partial, policy,
                                                                  seed):
    c = config(instances=instances, tool_workers=workers, staleness=staleness, partial_rollout=partial,
               policy=policy, steps=3, prompts_per_step=2, group=2)
    driver = EpisodeDriver(c, seed)
    driver.run()
    expected = {(s, p, g) for s in range(c.steps) for p in range(2) for g in range(2)}
    assert set(driver.trained) == expected and set(driver.trained.values()) == {1}
    assert max(driver.controller.staleness) <= staleness
    assert driver.peak_tools <= workers
