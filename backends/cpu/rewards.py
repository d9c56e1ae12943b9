"""Reward functions: built-in rules, and user callables "module:function".

A user reward is called as function(prompt: str, response: str, answer: str | None, metadata: dict)
and returns a number. One that raises is reported with the sample; the run does not die silently.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

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


def load_callable(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise RewardError(f"cannot load reward {spec!r}: {error}") from None


def build_reward(sources) -> WeightedReward:
    """From the IR's reward sources (rule(...) and python(...) calls)."""
    built = []
    for source in sources:
        if source.func == "rule":
            built.append((RULES[source.get("name")], source.get("weight")))
        elif source.func == "python":
            built.append((load_callable(source.get("function")), source.get("weight")))
        else:
            raise RewardError(f"the CPU backend has no {source.func}(...) reward yet; use rule or python")
    return WeightedReward(tuple(built))
