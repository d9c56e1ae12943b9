"""Events (driver -> controller) and actions (controller -> driver): plain frozen records."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

SampleId = tuple[int, int, int]  # (train step that consumes it, prompt within the step, index in group)


class Request(NamedTuple):  # made for every sample: a named tuple is built ~3x faster than a frozen dataclass
    sample: SampleId
    prompt_len: int
    version: int  # the policy version the instance generates it with (its oldest, under partial rollout)


# ---- events ----
@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class InstanceIdle:
    """The instance can hold `capacity` requests at once from now on (0: paused, e.g. offloaded)."""

    instance: int
    capacity: int


class SampleFinished(NamedTuple):  # one per sample, as Request
    sample: SampleId
    instance: int
    response_len: int  # tokens the model wrote (an episode's tool observations are not counted)
    turns: int = 1  # model turns (agentic episodes: one more than the tool calls it made)


class SamplesFinished(NamedTuple):  # one per decode step that finishes a sample: a named tuple, as Request
    """What one instance finished at one instant (one decode step), in the order it finished them:
    the controller handles them one after another and dispatches once (a driver reports a decode
    step's finishes together; a lone SampleFinished is handled as a batch of one)."""

    instance: int
    finished: tuple[SampleFinished, ...]


@dataclass(frozen=True)
class ToolCalled:
    """An episode's turn ended in a valid tool call: it leaves the decoding batch and waits on
    `instance`, which keeps its KV cache (sticky). `context`: tokens of its sequence so far (what
    moving it would re-prefill); `turns`, `generated`: turns taken and model tokens written."""

    sample: SampleId
    instance: int
    context: int
    turns: int
    generated: int


@dataclass(frozen=True)
class ToolReturned:
    """The tool call `runner` ran for the sample ended: "ok" or "error" (an observation the
    model reads), "timeout" or "crashed" (the episode ends, aspc/controller/episodes.py)."""

    sample: SampleId
    runner: int
    status: str


@dataclass(frozen=True)
class WorkFinished:
    work: int
    # a reward stage's scores of the work's samples, in order (None: masked), when the plan filters
    # groups (dynamic sampling, aspc/controller/dynamic_sampling.py); None otherwise
    rewards: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class WeightsPublished:
    version: int


@dataclass(frozen=True)
class WeightsLoaded:
    instance: int
    version: int


@dataclass(frozen=True)
class OptimizerDone:
    """The optimizer update of `step` is applied on the trainer (not yet handed out)."""

    step: int


@dataclass(frozen=True)
class PoolSwitched:
    """The time-shared pool now belongs to `mode`: "gen" (generation instances) or "learn"."""

    pool: str
    mode: str


@dataclass(frozen=True)
class InstanceFailed:
    instance: int


@dataclass(frozen=True)
class InstanceRecovered:
    instance: int


@dataclass(frozen=True)
class InstanceMoved:
    """A flexible generation instance now serves `role`: "learn" (its devices joined the trainer's
    data-parallel group) or "gen" (it generates again, once it loads the current weights)."""

    instance: int
    role: str


# ---- actions ----
@dataclass(frozen=True)
class Dispatch:
    instance: int
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Work:
    """A streamed unit of samples for one stage: reward, reference, critic, or train (fwd+bwd)."""

    id: int
    stage: str
    kind: str  # "reward" | "reference" | "critic" | "train"
    step: int
    samples: tuple[SampleId, ...]


@dataclass(frozen=True)
class RunTool:
    """Run the sample's pending tool call on tool runner `runner` (of the environment's tool_workers)."""

    sample: SampleId
    runner: int


@dataclass(frozen=True)
class ResumeEpisode:
    """Feed the tool's result to the episode and go on with its next turn on `instance`. When
    `instance` is not `home` (the instance holding its KV cache) the episode moves: its history is
    re-prefilled there and its slot on `home` is freed. A result that ends the episode (a timeout, a
    crashed worker) finishes it on `home`."""

    sample: SampleId
    instance: int
    home: int


@dataclass(frozen=True)
class RunWork:
    work: Work
    executor: int | None  # index into config.executors; None: a host stage the driver runs itself


@dataclass(frozen=True)
class OptimizerStep:
    step: int  # turns version `step` into `step + 1`


@dataclass(frozen=True)
class PublishWeights:
    """The trainer hands out `version` (after the optimizer step that made it)."""

    version: int


@dataclass(frozen=True)
class SwitchPool:
    """Give the time-shared pool to `mode` ("gen" or "learn"): offload one side, onload the other."""

    pool: str
    mode: str


@dataclass(frozen=True)
class SyncWeights:
    instance: int
    version: int
    interrupt: bool  # partial rollout: pause in-flight requests, load, resume them


@dataclass(frozen=True)
class MoveInstance:
    """Runtime rebalancing (aspc/controller/rebalance.py), at a step boundary on the trainer's
    executor: lend the drained generation instance's devices to the trainer ("learn": offload its
    engine, onload a shard of the training state) or hand them back ("gen": offload that shard;
    the instance then loads the current weights with a SyncWeights)."""

    instance: int
    role: str


@dataclass(frozen=True)
class RestartInstance:
    instance: int


@dataclass(frozen=True)
class Checkpoint:
    step: int


@dataclass(frozen=True)
class Finished:
    steps: int


# The closed unions: a driver handles every member with `match` and `assert_never`, so a new event
# or action breaks the type check where it is not handled instead of being dropped.
Event = (Start | InstanceIdle | SampleFinished | SamplesFinished | ToolCalled | ToolReturned | WorkFinished
         | OptimizerDone | WeightsPublished | WeightsLoaded | PoolSwitched | InstanceFailed | InstanceRecovered
         | InstanceMoved)
Action = (Dispatch | RunTool | ResumeEpisode | RunWork | OptimizerStep | PublishWeights | SyncWeights | SwitchPool
          | MoveInstance | RestartInstance | Checkpoint | Finished)
