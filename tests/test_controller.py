"""Property tests of the controller under random event orders, instance counts, lengths and
failures: no sample lost or duplicated, the staleness bound held, and under queue-aware dispatch
an idle instance never waits while another holds queued work it could take."""
import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspc.controller import Controller, ControllerConfig
from aspc.controller.events import (Dispatch, InstanceFailed, InstanceIdle, InstanceRecovered, OptimizerStep,
                                    RestartInstance, RunWork, SampleFinished, Start, SyncWeights,
                                    WeightsLoaded, WeightsPublished, WorkFinished)

configs = st.builds(
    ControllerConfig,
    steps=st.integers(1, 4), prompts_per_step=st.integers(1, 4), group=st.integers(1, 3),
    instances=st.integers(1, 4), staleness=st.integers(0, 2),
    policy=st.sampled_from(["queue_aware", "least_requests", "round_robin"]),
    group_affinity=st.booleans(), stream_micro=st.sampled_from([None, 1, 2, 6]),
    partial_rollout=st.integers(0, 2),
    forward_stages=st.sampled_from([(), (("score", "reward"),), (("score", "reward"), ("ref", "reference"))]),
    train_stage=st.just("update"), max_response=st.just(64))


class RandomDriver:
    """Carries out actions as a real driver would, but completes them in a random order."""

    def __init__(self, config, seed, fail_rate):
        self.rng = random.Random(seed)
        self.config, self.fail_rate = config, fail_rate
        self.controller = Controller(config, lambda step, prompt: 8 + prompt)
        self.events, self.trained = [], Counter()

    def act(self, actions):
        for a in actions:
            if isinstance(a, Dispatch):
                self.events += [SampleFinished(r.sample, a.instance, self.rng.randint(1, 64)) for r in a.requests]
            elif isinstance(a, RunWork):
                self.events.append(WorkFinished(a.work.id))
                if a.work.kind == "train":
                    self.trained.update(a.work.samples)
            elif isinstance(a, OptimizerStep):
                self.events.append(WeightsPublished(a.step + 1))
            elif isinstance(a, SyncWeights):
                self.events.append(WeightsLoaded(a.instance, a.version))
            elif isinstance(a, RestartInstance):
                self.events.append(InstanceRecovered(a.instance))

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
            self.act(self.controller.handle(event))
            if self.config.policy == "queue_aware":
                assert self.controller.idle_while_others_queue() == []
        raise AssertionError("did not finish")


def expected_samples(c):
    return {(s, p, g) for s in range(c.steps) for p in range(c.prompts_per_step) for g in range(c.group)}


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(configs, st.integers(0, 10**6), st.sampled_from([0.0, 0.02]))
def test_every_sample_trained_exactly_once_within_the_staleness_bound(config, seed, fail_rate):
    driver = RandomDriver(config, seed, fail_rate)
    driver.run()
    assert set(driver.trained) == expected_samples(config)
    assert all(count == 1 for count in driver.trained.values())
    assert max(driver.controller.staleness) <= config.staleness
    assert sum(driver.controller.staleness.values()) >= config.steps * config.samples_per_step


@SETTINGS
@given(configs, st.integers(0, 10**6))
def test_staleness_zero_is_on_policy(config, seed):
    config = ControllerConfig(**{**config.__dict__, "staleness": 0, "partial_rollout": 0})
    driver = RandomDriver(config, seed, 0.0)
    driver.run()
    assert set(driver.controller.staleness) == {0}


def test_a_failed_instance_has_its_work_requeued_and_redone():
    config = ControllerConfig(2, 2, 2, 2, 0, "queue_aware", True, None, 0, (), "update", 64)
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
