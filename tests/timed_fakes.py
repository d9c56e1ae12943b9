"""Executors of known, deterministic durations, for the local driver (on virtual time) and for
the simulator (as its pricing): the same plan through both must give the same action trace.

Every duration is a dyadic rational with few bits, so sums of them are exact in floating point
and both drivers compute the very same instants; the decode step differs per instance by a
power of two, so two instances never finish at the same instant (a tie both drivers would have
to break the same way).
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.backends.sim.instance import GenInstance
from aspc.controller.kinds import rule_for
from aspc.costmodel.learner import WorkCost
from aspc.costmodel.workload import sample_step

SLOTS = 6  # concurrent sequences per generation instance
LOAD = 0.25 + 2 ** -11  # a weight load on an instance
OPTIMIZER = 1.5 + 2 ** -14
PUBLISH = 0.5 + 2 ** -13
SWITCH = 0.625 + 2 ** -15  # a time-shared pool changing hands
FIXED = {"reference": 0.75 + 2 ** -16, "critic": 0.875 + 2 ** -17, "reward": 1.25 + 2 ** -18,
         "train": 2.5 + 2 ** -19, "judge": 1.75 + 2 ** -20}
PER_TOKEN = 2 ** -12


def decode_step(instance: int) -> float:
    return 1.0 + 2.0 ** (-9 - instance)


def work_seconds(kind: str, tokens: int) -> float:
    return FIXED[kind] + PER_TOKEN * tokens


class Workload:
    """The plan's seeded prompt and response lengths: what both drivers generate."""

    def __init__(self, plan):
        gen = plan.stages_of("generate")[0]
        self.data = plan.dataset(gen.data)
        self._steps: dict[int, list] = {}

    def sample(self, step: int, prompt: int, index: int):
        if step not in self._steps:
            self._steps[step] = sample_step(self.data, step)
        return self._steps[step][prompt * self.data.group + index]


# ---- the simulator's side ----
@dataclass(frozen=True)
class FakeDecode:
    """A GenerationCost of the fake: a fixed decode step, no prefill, no context cost."""

    step: float
    alpha: float = 0.0

    def beta(self, batch: int) -> float:
        return self.step

    def prefill(self, tokens: int, requests: int = 1) -> float:
        return 0.0


class FakePricing:
    def __init__(self, plan):
        self.plan = plan

    def generation_instance(self, stage, instance):
        return GenInstance(instance.index, FakeDecode(decode_step(instance.index)), SLOTS,
                           stage.batching != "continuous", instance.device_count)

    def load(self, devices: int, interrupt: bool) -> float:
        return LOAD

    def work(self, work, stage, token_lengths):
        judged = rule_for(stage).role == "judge"  # an LLM judge's verdicts: its own duration
        seconds = work_seconds("judge" if judged else work.kind, sum(token_lengths))
        return WorkCost(seconds, seconds, 0.0, 0.0)

    def optimizer(self) -> float:
        return OPTIMIZER

    def publish(self, devices: int, time_shared: bool) -> float:
        return PUBLISH

    def switch(self, devices: int) -> float:
        return SWITCH


# ---- the local driver's side ----
@dataclass
class Finished:
    key: tuple
    prompt: list
    response: list
    logprobs: list


@dataclass
class Rollout:
    key: tuple
    tokens: int
    reward: float = 0.0  # what a judge or a reward model sets (the roles' contract)
    task_reward: float = 0.0


class FakeEngine:
    def __init__(self, time, index: int, workload: Workload):
        self.time, self.dt, self.workload = time, decode_step(index), workload
        self.slots = SLOTS
        self.left: dict[tuple, int] = {}
        self.prompts: dict[tuple, list] = {}

    @property
    def busy(self) -> bool:
        return bool(self.left)

    def add(self, key, ids, seed) -> None:
        self.left[key] = self.workload.sample(*key).response_len
        self.prompts[key] = ids

    def step(self) -> list:
        self.time.sleep(self.dt)
        done = []
        for key in sorted(self.left):
            self.left[key] -= 1
            if self.left[key] == 0:
                del self.left[key]
                length = self.workload.sample(*key).response_len
                done.append(Finished(key, self.prompts.pop(key), [0] * length, [0.0] * length))
        return done

    def load_weights(self, state) -> None:
        self.time.sleep(LOAD)


class FakeTrainer:
    def __init__(self, time):
        self.time = time
        self.log: list = []

    def _run(self, kind: str, rollouts) -> None:
        self.time.sleep(work_seconds(kind, sum(r.tokens for r in rollouts)))

    def reward(self, rollouts) -> None:
        pass  # a rule reward: on the host, no time

    def reference(self, rollouts) -> None:
        self._run("reference", rollouts)

    def values(self, rollouts) -> None:
        self._run("critic", rollouts)

    def train(self, rollouts) -> None:
        self._run("train", rollouts)

    def optimizer_step(self) -> dict:
        self.time.sleep(OPTIMIZER)
        return {}

    def snapshot(self):
        self.time.sleep(PUBLISH)
        return None


class FakeForwardModel:
    def __init__(self, time, kind: str):
        self.time, self.kind = time, kind

    def score(self, rollouts) -> None:
        self.time.sleep(work_seconds(self.kind, sum(r.tokens for r in rollouts)))


class FakeJudge:
    def __init__(self, time):
        self.time = time

    def judge(self, rollouts) -> None:
        self.time.sleep(work_seconds("judge", sum(r.tokens for r in rollouts)))


@dataclass
class Prompt:
    ids: list


class FakeExecutors:
    """The Executors protocol of aspc/roles.py, on virtual time."""

    platform = "fake"
    user_errors = ()
    checkpoint_error = RuntimeError

    def __init__(self, time, plan):
        self.time, self.plan = time, plan
        self.workload = Workload(plan)
        self.pps = self.workload.data.prompts_per_step
        self._trainer = FakeTrainer(time)

    @staticmethod
    def set_threads(count: int) -> int:
        return 1

    def prompt(self, index: int) -> Prompt:
        step, prompt = divmod(index, self.pps)
        return Prompt([1] * self.workload.sample(step, prompt, 0).prompt_len)

    def warm_start(self, steps: int, on_step=None) -> None:
        pass

    def snapshot(self):
        return None

    def generation_engine(self, index: int, instances: int) -> FakeEngine:
        return FakeEngine(self.time, index, self.workload)

    def trainer(self) -> FakeTrainer:
        return self._trainer

    def forward_model(self, stage: str, instance: int) -> FakeForwardModel:
        return FakeForwardModel(self.time, self.plan.stage(stage).kind)

    def judge(self, stage: str, instance: int) -> FakeJudge:
        return FakeJudge(self.time)

    def switch_pool(self, pool: str, mode: str) -> None:
        self.time.sleep(SWITCH)

    def rollout(self, sample, finished, prompt) -> Rollout:
        return Rollout(sample, len(finished.prompt) + len(finished.response))

    def parts(self, trainer):
        return {}, {}
