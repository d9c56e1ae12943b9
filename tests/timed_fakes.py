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
from aspc.controller.episodes import EpisodePolicy
from aspc.controller.kinds import rule_for
from aspc.costmodel.learner import WorkCost
from aspc.controller.config import ControllerConfig
from aspc.costmodel.workload import Environment, draw_episode, draw_rewards, sample_step
from aspc.drivers.sim.episodes import plan_episode

SLOTS = 6  # concurrent sequences per generation instance
LOAD = 0.25 + 2 ** -11  # a weight load on an instance
OPTIMIZER = 1.5 + 2 ** -14
PUBLISH = 0.5 + 2 ** -13
SWITCH = 0.625 + 2 ** -15  # a time-shared pool changing hands
MOVE = 0.375 + 2 ** -21  # runtime rebalancing: a generation instance joining or leaving the trainer
FIXED = {"reference": 0.75 + 2 ** -16, "critic": 0.875 + 2 ** -17, "reward": 1.25 + 2 ** -18,
         "train": 2.5 + 2 ** -19, "judge": 1.75 + 2 ** -20}
PER_TOKEN = 2 ** -12


def decode_step(instance: int) -> float:
    return 1.0 + 2.0 ** (-9 - instance)


def work_seconds(kind: str, tokens: int) -> float:
    return FIXED[kind] + PER_TOKEN * tokens


class Workload:
    """The plan's seeded prompt and response lengths, and its episodes when the plan has an
    environment (drawn as the simulator draws them): what both drivers generate."""

    def __init__(self, plan):
        gen = plan.stages_of("generate")[0]
        self.data = plan.dataset(gen.data)
        self.stride = ControllerConfig.from_plan(plan, 1).prompt_stride  # prompts drawn per step
        self.solve_rates = dict(plan.stages_of("train")[0].options).get("solve_rates")
        self._steps: dict[int, list] = {}
        envs = plan.stages_of("environment")
        self.env = Environment.of(dict(envs[0].options)) if envs else None
        self.policy = EpisodePolicy.of(envs[0]) if envs else None
        self._episodes: dict = {}

    def sample(self, step: int, prompt: int, index: int):
        if step not in self._steps:
            self._steps[step] = sample_step(self.data, step, prompts_drawn=self.stride)
        return self._steps[step][prompt * self.data.group + index]

    def reward(self, key) -> float:
        """The sample's reward as the simulator draws it under dynamic sampling (else 0)."""
        return draw_rewards(self.data, self.solve_rates, *key[:2])[key[2]] if self.solve_rates else 0.0

    def episode(self, key):
        """The sample's EpisodePlan (turns, tool calls, how it ends); None without an environment."""
        if self.env is None:
            return None
        if key not in self._episodes:
            draw = draw_episode(self.env, self.data, *key, self.sample(*key).response_len)
            self._episodes[key] = plan_episode(self.env, self.policy, draw)
        return self._episodes[key]


# ---- the simulator's side ----
@dataclass(frozen=True)
class FakeDecode:
    """A GenerationCost of the fake: a fixed decode step, no prefill, no context cost."""

    step: float
    alpha: float = 0.0

    def beta(self, batch: int) -> float:
        return self.step

    def prefill(self, tokens: int, requests: int = 1, squares: float = 0.0) -> float:
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

    def optimizer(self, loading: bool = False) -> float:
        return OPTIMIZER

    def publish(self, devices: int, time_shared: bool) -> float:
        return PUBLISH

    def switch(self, devices: int) -> float:
        return SWITCH

    def move(self, devices: int) -> float:
        return MOVE


# ---- the local driver's side ----
@dataclass
class Finished:
    key: tuple
    prompt: list
    response: list
    logprobs: list
    mask: list | None = None
    episode: dict | None = None


@dataclass(frozen=True)
class FakeCall:
    tool: str
    seconds: float
    status: str


@dataclass(frozen=True)
class PendingCall:
    key: tuple
    call: FakeCall
    context: int
    turns: int
    generated: int


@dataclass(frozen=True)
class ToolResult:
    status: str
    observation: str = ""


class FakeTools:
    """The ToolRunner role: a call takes the seconds the episode plan drew for it."""

    def __init__(self, time):
        self.time = time

    def run(self, call: FakeCall) -> ToolResult:
        self.time.sleep(call.seconds)
        return ToolResult(call.status)


@dataclass
class Rollout:
    key: tuple
    tokens: int
    reward: float = 0.0  # what a judge or a reward model sets (the roles' contract)
    task_reward: float = 0.0


class FakeEngine:
    """A generation instance of fixed decode steps; agentic episodes turn by turn, as the
    simulator's instance runs them (a turn ending in a tool call holds its slot until resumed)."""

    def __init__(self, time, index: int, workload: Workload):
        self.time, self.dt, self.workload = time, decode_step(index), workload
        self.slots = SLOTS
        self.left: dict[tuple, int] = {}
        self.prompts: dict[tuple, list] = {}
        self.turn: dict[tuple, int] = {}  # an episode's current turn
        self.held: dict[tuple, int] = {}  # episodes on a tool call
        self.calls: list[PendingCall] = []

    @property
    def busy(self) -> bool:
        return bool(self.left)

    def add(self, key, ids, seed) -> None:
        episode = self.workload.episode(key)
        self.left[key] = episode.turns[0] if episode else self.workload.sample(*key).response_len
        self.prompts[key] = ids
        self.turn[key] = 0

    def step(self) -> list:
        self.time.sleep(self.dt)
        done = []
        for key in sorted(self.left):
            self.left[key] -= 1
            if self.left[key] == 0:
                del self.left[key]
                episode, t = self.workload.episode(key), self.turn[key]
                if episode is not None and t < len(episode.calls):  # a tool call follows this turn
                    self.held[key] = t
                    call = episode.calls[t]
                    status = "timeout" if t == len(episode.turns) - 1 else "ok"
                    self.calls.append(PendingCall(key, FakeCall(call.tool, call.seconds, status), self._context(key),
                                                  t + 1, sum(episode.turns[:t + 1])))
                else:
                    done.append(self._finished(key))
        return done

    def _context(self, key) -> int:
        episode, t = self.workload.episode(key), self.turn[key]
        return len(self.prompts[key]) + sum(episode.turns[:t + 1]) + sum(c.observation for c in episode.calls[:t])

    def _finished(self, key) -> Finished:
        episode = self.workload.episode(key)
        self.turn.pop(key)
        if episode is None:
            length = self.workload.sample(*key).response_len
            return Finished(key, self.prompts.pop(key), [0] * length, [0.0] * length)
        model, observed = episode.model_tokens, episode.observation_tokens
        return Finished(key, self.prompts.pop(key), [0] * (model + observed), [0.0] * (model + observed),
                        [1] * model + [0] * observed, {"turns": len(episode.turns)})

    def pop_calls(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    def resume(self, key, result) -> list:
        del self.held[key]
        if result.status in ("timeout", "crashed"):
            return [self._finished(key)]
        self.turn[key] += 1
        self.left[key] = self.workload.episode(key).turns[self.turn[key]]
        return []

    def detach(self, key):
        del self.held[key]
        return key, self.prompts.pop(key), self.turn.pop(key)

    def adopt(self, state, result) -> list:
        key, self.prompts[key], self.turn[key] = state
        self.held[key] = self.turn[key]
        return self.resume(key, result)

    def load_weights(self, state) -> None:
        self.time.sleep(LOAD)


class FakeTrainer:
    def __init__(self, time, workload=None):
        self.time, self.workload = time, workload
        self.log: list = []

    def _run(self, kind: str, rollouts) -> None:
        self.time.sleep(work_seconds(kind, sum(r.tokens for r in rollouts)))

    def reward(self, rollouts) -> None:  # a rule reward: on the host, no time
        for r in rollouts:
            r.reward = self.workload.reward(r.key) if self.workload else 0.0

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


class FakeReferenceModel:
    def __init__(self, time):
        self.time = time

    def reference(self, rollouts) -> None:
        self.time.sleep(work_seconds("reference", sum(r.tokens for r in rollouts)))


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
        self._trainer = FakeTrainer(time, self.workload)

    @staticmethod
    def set_threads(count: int) -> int:
        return 1

    def prompt(self, index: int) -> Prompt:
        step, prompt = divmod(index, self.workload.stride)
        return Prompt([1] * self.workload.sample(step, prompt, 0).prompt_len)

    def warm_start(self, steps: int, on_step=None) -> None:
        pass

    def snapshot(self):
        return None

    def generation_engine(self, index: int, instances: int) -> FakeEngine:
        return FakeEngine(self.time, index, self.workload)

    def trainer(self) -> FakeTrainer:
        return self._trainer

    def tools(self) -> FakeTools:
        return FakeTools(self.time)

    def forward_model(self, stage: str, instance: int) -> FakeForwardModel:
        return FakeForwardModel(self.time, self.plan.stage(stage).kind)

    def judge(self, stage: str, instance: int) -> FakeJudge:
        return FakeJudge(self.time)

    def reference_model(self, stage: str, instance: int) -> FakeReferenceModel:
        return FakeReferenceModel(self.time)

    def switch_pool(self, pool: str, mode: str) -> None:
        self.time.sleep(SWITCH)

    def move_instance(self, instance: int, role: str) -> None:
        self.time.sleep(MOVE)

    def rollout(self, sample, finished, prompt) -> Rollout:
        return Rollout(sample, len(finished.prompt) + len(finished.response))

    def parts(self, trainer):
        return {}, {}
