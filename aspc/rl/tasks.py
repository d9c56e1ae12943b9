"""Built-in verifiable tasks a tiny model learns on a CPU, with long-tailed answer lengths.

  arith  "37+5=" -> "42"             operand sizes drawn long-tailed
  count  "#6=" -> "123456"           count up to n, n long-tailed: answer length = n
  copy   "c:4071=" -> "4071"         copy a string whose length is long-tailed
  mul    "417*63=" -> "26271"        multiplication a tiny model cannot do alone (agentic: a calculator)

Prompts are generated from a seed; prompt i of a data set is the same in every run.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def _long_tail(rng: random.Random, mean: float, cap: int) -> int:
    """A lognormal length (sigma 0.7) with the given mean, in 1..cap."""
    sigma = 0.7
    value = math.exp(math.log(mean) - sigma * sigma / 2 + sigma * rng.gauss(0, 1))
    return max(1, min(cap, round(value)))


def arith(rng: random.Random, max_response: int) -> Example:
    digits = _long_tail(rng, 1.6, max(1, min(6, max_response - 1)))
    a = rng.randint(0, 10 ** digits - 1)
    b = rng.randint(0, 9)
    return Example(f"{a}+{b}=", str(a + b))


def count(rng: random.Random, max_response: int) -> Example:
    n = _long_tail(rng, 4, min(9, max_response))
    return Example(f"#{n}=", "".join(str(i) for i in range(1, n + 1)))


def copy(rng: random.Random, max_response: int) -> Example:
    n = _long_tail(rng, 3, min(12, max_response))
    text = "".join(rng.choice("0123456789") for _ in range(n))
    return Example(f"c:{text}=", text)


def mul(rng: random.Random, max_response: int) -> Example:
    a, b = rng.randint(10, 999), rng.randint(10, 99)
    return Example(f"{a}*{b}=", str(a * b))


TASKS = {"arith": arith, "count": count, "copy": copy, "mul": mul}


def example(task: str, seed: int, index: int, max_response: int) -> Example:
    """The index-th example of a task's data set for a seed (deterministic, no state)."""
    return TASKS[task](random.Random(f"{task}/{seed}/{index}"), max_response)
