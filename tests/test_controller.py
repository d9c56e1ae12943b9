"""Property tests of the controller under random event orders, instance counts, lengths and
failures: no sample lost or duplicated, the staleness bound held, and under queue-aware dispatch
an idle instance never waits while another holds queued work it could take."""
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspc.controller import Controller, ControllerConfig
from aspc.controller.config import ExecutorSpec, RoutedStage
from aspc.controller.events import (Dispatch, InstanceFailed, InstanceIdle, InstanceRecovered, OptimizerDone,
                                    OptimizerStep, PoolSwitched, PublishWeights, RestartInstance, RunWork,
                                    SampleFinished, Start, SwitchPool, SyncWeights, WeightsLoaded, WeightsPublished,
                                    WorkFinished)

SCORE, REF = RoutedStage("score", "reward", None), RoutedStage("ref", "reference", "trainer")
RM = RoutedStage("score", "reward", "forward_model")
RM_AS_FINISHED = RoutedStage("score", "reward", "forward_model", per_group=True)  # scores each group at once


def executors(forward: tuple, time_shared: bool) -> tuple:
    """The trainer's devices (with the reference on them), and two reward-model instances."""
    trainer = ExecutorSpec("learner", "gpus", (0,), (("update", 0),) + ((("ref", 0),) if REF in forward else ()),
                           time_shared)
    judges = tuple(ExecutorSpec(f"judges[{k}]", "judges", (k,), (("score", k),), False) for k in range(2))
    return (trainer,) + (judges if RM in forward or RM_AS_FINISHED in forward else ())


@st.composite
def configs(draw):
    forward = draw(st.sampled_from([(), (SCORE,), (SCORE, REF), (RM,), (RM, REF), (RM_AS_FINISHED,),
                                    (RM_AS_FINISHED, REF)]))
    time_shared = draw(st.booleans())
    return ControllerConfig(
        steps=draw(st.integers(1, 4)), prompts_per_step=draw(st.integers(1, 4)), group=draw(st.integers(1, 3)),
        instances=draw(st.integers(1, 4)), staleness=draw(st.integers(0, 2)),
        policy=draw(st.sampled_from(["queue_aware", "least_requests", "round_robin"])),
        group_affinity=draw(st.booleans()), stream_micro=draw(st.sampled_from([None, 1, 2, 6])),
        partial_rollout=draw(st.integers(0, 2)), forward_stages=forward, train_stage="update", max_response=64,
        executors=executors(forward, time_shared), gen_pool="gpus", train_whole_step=draw(st.booleans()))


class RandomDriver:
    """Carries out actions as a real driver would, but completes them in a random order."""

    def __init__(self, config, seed, fail_rate):
        self.rng = random.Random(seed)
        self.config, self.fail_rate = config, fail_rate
        self.controller = Controller(config, lambda step, prompt: 8 + prompt)
        self.events, self.trained = [], Counter()
        self.generated: set = set()  # samples whose finish the controller was told

    def act(self, actions):
        for a in actions:
            if isinstance(a, Dispatch):
                self.events += [SampleFinished(r.sample, a.instance, self.rng.randint(1, 64)) for r in a.requests]
            elif isinstance(a, RunWork):
                self.events.append(WorkFinished(a.work.id))
                if a.work.kind == "train":
                    self.trained.update(a.work.samples)
                    self._require_whole_step(a.work.step)
            elif isinstance(a, OptimizerStep):
                self.events.append(OptimizerDone(a.step))
            elif isinstance(a, PublishWeights):
                self.events.append(WeightsPublished(a.version))
            elif isinstance(a, SwitchPool):
                self.events.append(PoolSwitched(a.pool, a.mode))
            elif isinstance(a, SyncWeights):
                self.events.append(WeightsLoaded(a.instance, a.version))
            elif isinstance(a, RestartInstance):
                self.events.append(InstanceRecovered(a.instance))

    def _require_whole_step(self, step: int) -> None:
        """train_whole_step: no unit of a step trains before every sample of the step is generated."""
        if self.config.train_whole_step:
            c = self.config
            assert {(step, p, g) for p in range(c.prompts_per_step) for g in range(c.group)} <= self.generated

    def run(self):
        self.act(self.controller.handle(Start()))
        for i in range(self.config.instances):
            self.act(self.controller.handle(InstanceIdle(i, self.rng.randint(1, 5))))
        for _ in range(100_000):
            if self.controller.finished:
                return
            assert self.events, "deadlock: the controller waits for nothing"
            if self.fail_rate and self.rng.random() < self.fail_rate:
                self.events.append(InstanceFailed(self.rng.randrange(self.config.instances)))
            event = self.events.pop(self.rng.randrange(len(self.events)))
            if isinstance(event, SampleFinished):
                self.generated.add(event.sample)
            self.act(self.controller.handle(event))
            if self.config.policy == "queue_aware":
                assert self.controller.idle_while_others_queue() == []
        raise AssertionError("did not finish")


def expected_samples(c):
    return {(s, p, g) for s in range(c.steps) for p in range(c.prompts_per_step) for g in range(c.group)}


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(configs(), st.integers(0, 10**6), st.sampled_from([0.0, 0.02]))
def test_every_sample_trained_exactly_once_within_the_staleness_bound(config, seed, fail_rate):
    driver = RandomDriver(config, seed, fail_rate)
    driver.run()
    assert set(driver.trained) == expected_samples(config)
    assert all(count == 1 for count in driver.trained.values())
    assert max(driver.controller.staleness) <= config.staleness
    assert sum(driver.controller.staleness.values()) >= config.steps * config.samples_per_step


@SETTINGS
@given(configs(), st.integers(0, 10**6))
def test_staleness_zero_is_on_policy(config, seed):
    config = ControllerConfig(**{**config.__dict__, "staleness": 0, "partial_rollout": 0})
    driver = RandomDriver(config, seed, 0.0)
    driver.run()
    assert set(driver.controller.staleness) == {0}


def test_a_failed_instance_has_its_work_requeued_and_redone():
    config = ControllerConfig(2, 2, 2, 2, 0, "queue_aware", True, None, 0, (), "update", 64, executors((), False))
    c = Controller(config, lambda s, p: 4)
    c.handle(Start())
    dispatched = c.handle(InstanceIdle(0, 8))
    assert dispatched and isinstance(dispatched[0], Dispatch)
    lost = [r.sample for r in dispatched[0].requests]
    actions = c.handle(InstanceFailed(0))
    assert any(isinstance(a, RestartInstance) for a in actions)
    retry = c.handle(InstanceIdle(1, 8))
    assert {r.sample for a in retry if isinstance(a, Dispatch) for r in a.requests} >= set(lost)
    assert c.handle(SampleFinished(lost[0], 0, 5)) == []  # a late result of the dead instance is dropped
