"""The executor roles: what the local and Ray drivers ask of a backend, and nothing more.

A backend provides an `Executors` factory for its platform (the CPU backend:
`aspc.backends.cpu.executors.CpuExecutors`); the CLI or a test hands it to a driver, so the
drivers import no backend module (a contract in pyproject.toml). The roles follow DESIGN.md:
a `GenerationEngine` per instance and a `Trainer`; forward models, judges and tool runners join
them as the issues that execute those stages land.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable


class GenerationEngine(Protocol):
    busy: bool

    def add(self, key: Any, ids: list[int], seed: int) -> None: ...

    def step(self) -> list: ...  # finished samples: .key, .prompt, .response, .logprobs

    def load_weights(self, state: Any) -> None: ...


class Trainer(Protocol):
    """Reward, reference and critic passes and the policy update, per streamed unit of rollouts."""

    def reward(self, rollouts: list) -> None: ...

    def reference(self, rollouts: list) -> None: ...

    def values(self, rollouts: list) -> None: ...

    def train(self, rollouts: list) -> None: ...

    def optimizer_step(self) -> dict: ...

    def snapshot(self) -> Any: ...


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

    def generation_engine(self, instances: int) -> GenerationEngine: ...

    def trainer(self) -> Trainer: ...

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
