"""Reward functions: built-in rules, and user callables "module:function".

A user reward is called as function(prompt: str, response: str, answer: str | None, metadata: dict)
and returns a number. One that raises is reported with the sample; the run does not die silently.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from aspc.frontend.user_code import UserCodeError, load_function

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    return float(answer is not None and response.strip() == answer.strip())


def numeric_match(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    numbers = _NUMBER.findall(response)
    if answer is None or not numbers:
        return 0.0
    try:
        return float(abs(float(numbers[-1]) - float(answer)) < 1e-6)
    except ValueError:
        return 0.0


def math_verify(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """The last number of the response (or its \\boxed{} content) equals the answer."""
    boxed = re.findall(r"\\boxed\{([^}]*)\}", response)
    return numeric_match(prompt, boxed[-1] if boxed else response, answer, metadata)


RULES: dict[str, Callable] = {"exact_match": exact_match, "numeric_match": numeric_match,
                              "math_verify": math_verify}


class RewardError(Exception):
    """A reward function failed on a sample (the message names the sample)."""


@dataclass(frozen=True)
class WeightedReward:
    sources: tuple  # (callable, weight)

    def __call__(self, prompt: str, response: str, answer: str | None, metadata: dict) -> float:
        total = 0.0
        for function, weight in self.sources:
            try:
                total += weight * float(function(prompt, response, answer, metadata))
            except Exception as error:  # a user's function: report it with the sample
                raise RewardError(f"reward {getattr(function, '__name__', function)} failed on prompt "
                                  f"{prompt!r}, response {response!r}: {type(error).__name__}: {error}") from None
        return total


def load_callable(spec: str, base_dir: Path | None = None) -> Callable:
    """The user's "module:function", the module looked up beside the .aspl file (`base_dir`) first,
    as `aspc check` finds it. It pickles as (spec, base_dir), so a Ray worker loads it the same way."""
    base_dir = Path(base_dir).resolve() if base_dir is not None else None  # a Ray worker's cwd differs
    try:
        return _UserFunction(spec, base_dir, load_function(spec, base_dir))
    except UserCodeError as error:
        raise RewardError(f"cannot load reward {spec!r}: {error.message}") from None


class _UserFunction:
    def __init__(self, spec: str, base_dir: Path | None, function: Callable):
        self.spec, self.base_dir, self.function, self.__name__ = spec, base_dir, function, spec

    def __call__(self, *args):
        return self.function(*args)

    def __reduce__(self):
        return load_callable, (self.spec, self.base_dir)


def build_reward(sources, base_dir: Path | None = None) -> WeightedReward:
    """From the IR's reward sources (rule(...) and python(...) calls); python modules are looked
    up beside the .aspl file (`base_dir`) first."""
    built = []
    for source in sources:
        if source.func == "rule":
            built.append((RULES[source.get("name")], source.get("weight")))
        elif source.func == "python":
            built.append((load_callable(source.get("function"), base_dir), source.get("weight")))
        else:
            raise RewardError(f"the CPU backend has no {source.func}(...) reward yet; use rule or python")
    return WeightedReward(tuple(built))
