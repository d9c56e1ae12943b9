"""The executor roles: what the drivers ask of a backend, and nothing more.

A backend provides an `Executors` factory for its platform (the CPU backend:
`aspc.backends.cpu.executors.CpuExecutors`; the simulator's priced executors are
`aspc.backends.sim.pricing.RooflinePricing`); the CLI picks it by the plan's hardware
(aspc/cli/backends.py) and hands it to a driver, so the drivers import no backend module (a
contract in pyproject.toml). Which role runs a stage is the stage-kind table's
(aspc/controller/kinds.py):

- `GenerationEngine` — one generation instance: takes requests, steps, loads weights.
- `Trainer` — the policy's learner: reference, critic and train passes per streamed unit, the
  optimizer step, the weights it publishes (and a rule or python reward, on the host).
- `ForwardModel` — a model that scores token sequences on its own devices (a reward model).
- `Judge` — a generation engine used as a scorer (an LLM judge): it writes a verdict per rollout.
- `ToolRunner` — runs one tool call of an environment episode to its end (`Executors.tools()`);
  the driver calls it from one thread per runner, on the controller's RunTool.

Optional capabilities a factory may have, each a Protocol of its own whose presence the driver reads
from a declared attribute, never by probing undeclared names:
- `LearnerInActor` (`Executors.learner_in_actor` True: the Ascend factory) — a learner that cannot be
  pickled into a Ray actor, so the Ray driver has the learner's actor build it from the factory;
- `InstanceMover` (`move_instance`, read with getattr and a None default) — runtime rebalancing
  moves a generation instance's devices to or from the trainer;
- `LearnerSaver` (`checkpoint_writer`, read the same way) — a learner in its own process writes its
  checkpoint itself;
- `Pricing` — the simulator's executors (backends/sim/pricing.py): what a unit of work costs.

tests/test_roles_complete.py checks that every attribute the drivers use on a factory is declared here.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class GenerationEngine(Protocol):
    slots: int  # requests it holds at once

    @property
    def busy(self) -> bool: ...  # something in flight to step

    def add(self, key: Any, ids: list[int], seed: int) -> None: ...

    def step(self) -> list: ...  # finished samples: .key, .prompt, .response, .logprobs

    def load_weights(self, state: Any) -> None: ...


class EpisodeEngine(GenerationEngine, Protocol):
    """A generation engine of agentic episodes (an environment stage): a turn ending in a tool
    call holds its slot (`held`) until the driver resumes it with the tool's result."""

    held: dict

    def pop_calls(self) -> list: ...  # turns ended by a call: .key, .call, .context, .turns, .generated

    def resume(self, key: Any, result: Any) -> list: ...  # finished samples (the episode may end)

    def detach(self, key: Any) -> Any: ...  # the episode leaves (moved): its state

    def adopt(self, state: Any, result: Any) -> list: ...  # a moved episode: its history prefilled here


class Trainer(Protocol):
    """Reward, reference and critic passes and the policy update, per streamed unit of rollouts."""

    def reward(self, rollouts: list) -> None: ...

    def reference(self, rollouts: list) -> None: ...

    def values(self, rollouts: list) -> None: ...

    def train(self, rollouts: list) -> None: ...

    def optimizer_step(self) -> dict: ...

    def snapshot(self) -> Any: ...  # the weights to publish


class ForwardModel(Protocol):
    def score(self, rollouts: list) -> None: ...  # sets each rollout's reward


class ReferenceModel(Protocol):
    """A reference stage on executors apart from the trainer's: its own frozen reference model."""

    def reference(self, rollouts: list) -> None: ...  # sets each rollout's ref_logprobs


class Judge(Protocol):
    """Generates a verdict per rollout and sets its reward; raises when a call fails. The driver
    calls it under the source's failure policy (aspc/controller/scoring.py), one call per sample,
    on copies: a failed sample gets the fallback reward and `masked = True`."""

    def judge(self, rollouts: list) -> None: ...


class ToolRunner(Protocol):
    def run(self, call: Any) -> Any: ...  # a ToolResult: .status ("ok"|"error"|"timeout"|"crashed"), .observation


class Executors(Protocol):
    """One run's executors, built from the plan; `user_errors` are the exceptions a user can cause
    (bad data, a failing reward, an unusable checkpoint), reported as one message."""

    platform: str
    user_errors: tuple[type[Exception], ...]
    checkpoint_error: type[Exception]
    set_threads: Callable[[int], int]
    # True: the factory is a LearnerInActor (the Ray driver reads it with getattr, default False)
    learner_in_actor: bool

    def prompt(self, index: int) -> Any: ...

    def warm_start(self, steps: int, on_step: Callable | None = None) -> None: ...

    def snapshot(self) -> Any: ...

    def generation_engine(self, index: int, instances: int) -> GenerationEngine: ...

    def trainer(self) -> Trainer: ...

    def forward_model(self, stage: str, instance: int) -> ForwardModel: ...

    def judge(self, stage: str, instance: int) -> Judge: ...

    def reference_model(self, stage: str, instance: int) -> ReferenceModel: ...

    def tools(self) -> ToolRunner: ...  # the environment's tools (plans with an environment stage)

    def switch_pool(self, pool: str, mode: str) -> None: ...  # offload one side, onload the other

    def rollout(self, sample: Any, finished: Any, prompt: Any) -> Any: ...

    def accuracy(self, count: int = 128) -> float: ...

    def parts(self, trainer: Trainer) -> tuple[dict, dict]: ...

    def save_checkpoint(self, directory: Path, version: int, models: dict, optimizers: dict,
                        extra: dict) -> Path: ...

    def load_checkpoint(self, path: Path, models: dict, optimizers: dict) -> dict: ...

    def find_resume_point(self, directory: Path) -> Any: ...

    def read_manifest(self, path: Path) -> dict: ...

    def step_folders(self, directory: Path) -> list: ...

    # optional (the local driver reads it with getattr and a None default): the run is over, after a
    # failure too: the factory ends what it started (tool runners' processes, scorers' processes)
    def close(self) -> None: ...


class LearnerInActor(Executors, Protocol):
    """A factory whose learner is built where it runs (`learner_in_actor` True: megatron's rank 0,
    with its process groups and weight sender, cannot be pickled into a Ray actor). The Ray driver
    (aspc/drivers/ray/runtime.py) places the learner's actor on `learner_address()`, hands it the
    factory, and has each engine's actor and the learner's join the instance's weight-transfer group."""

    def engine_address(self, index: int, rank: int = 0) -> str: ...  # the node of an instance's devices

    def learner_address(self) -> str: ...  # the node of trainer rank 0

    def engines_in_actors(self) -> None: ...  # the driver's actors start the engines (on the devices they hold)

    def unstarted_engine(self, index: int, instances: int) -> GenerationEngine: ...  # before it joins its group

    def transfer_info(self, index: int) -> dict: ...  # what the engine's side joins its group with

    def join_trainer_side(self, index: int) -> None: ...  # in the learner's process: join instance's group


class InstanceMover(Protocol):
    """A factory that moves a generation instance's devices to or from the trainer (runtime
    rebalancing); without it, a lent instance simply gets no work (aspc/drivers/local/runtime.py)."""

    def move_instance(self, instance: int, role: str) -> None: ...


class LearnerSaver(Protocol):
    """A factory whose checkpoint a learner in a process of its own can write itself (read with
    getattr and a None default; aspc/drivers/local/runtime.py): without it the learner's state comes
    to the driver to be saved."""

    def checkpoint_writer(self, extra: dict) -> Callable[[Path, int, dict, dict], Path]: ...
    # save_checkpoint's work as a picklable function of (directory, version, models, optimizers),
    # `extra` in its manifest


class Pricing(Protocol):
    """What the simulator asks of its executors (backends/sim/pricing.py; a test's fake). `cores`
    (optional, read with getattr and a None default): the shared CPU cores of a calibrated run."""

    cores: Any  # optional: aspc/costmodel/cores.py's shared cores; absent on the roofline

    def generation_instance(self, stage: Any, instance: Any) -> Any: ...  # a GenInstance

    def load(self, devices: int, interrupt: bool) -> float: ...

    def work(self, work: Any, stage: Any, token_lengths: list[int]) -> Any: ...  # a WorkCost

    def optimizer(self, loading: bool = False) -> float: ...  # loading: an instance loads weights meanwhile

    def publish(self, devices: int, time_shared: bool) -> float: ...

    def switch(self, devices: int) -> float: ...

    def move(self, devices: int) -> float: ...  # a generation instance joins or leaves the trainer


ExecutorsFactory = Callable[[Any, "Path | None", int], Executors]  # (plan, .aspl folder, seed)
