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
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class GenerationEngine(Protocol):
    busy: bool
    slots: int  # requests it holds at once

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

    def prompt(self, index: int) -> Any: ...

    def warm_start(self, steps: int, on_step: Callable | None = None) -> None: ...

    def snapshot(self) -> Any: ...

    def generation_engine(self, index: int, instances: int) -> GenerationEngine: ...

    def trainer(self) -> Trainer: ...

    def forward_model(self, stage: str, instance: int) -> ForwardModel: ...

    def judge(self, stage: str, instance: int) -> Judge: ...

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


ExecutorsFactory = Callable[[Any, "Path | None", int], Executors]  # (plan, .aspl folder, seed)
