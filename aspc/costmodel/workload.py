"""The workload model: seeded prompt and response lengths for one training step.

Per-prompt lognormal response lengths, correlated within a prompt's group, truncated at the cap
(the point mass there is the share of responses cut off). Used by the pack pass to choose shape
buckets and by the simulator; deterministic for a data spec, a step and a seed.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from aspc.ir.graph import DataSpec
from aspc.ir.values import Call

DEFAULT_SIGMA = 0.8
DEFAULT_GROUP_CORR = 0.5


@dataclass(frozen=True)
class Sample:
    prompt: int  # index of the prompt within the step
    prompt_len: int
    response_len: int

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.response_len


def default_response_lengths(data: DataSpec) -> Call:
    """Undeclared: a long tail with a mean of a quarter of the cap (shared/FACTS.md: max/mean 7-14x)."""
    return Call("lognormal", (("group_corr", DEFAULT_GROUP_CORR), ("mean", data.max_response / 4),
                              ("sigma", DEFAULT_SIGMA)))


def default_prompt_lengths(data: DataSpec) -> Call:
    return Call("uniform", (("max", max(1, data.max_prompt // 2)), ("min", max(1, data.max_prompt // 8))))


def sample_step(data: DataSpec, step: int, seed: int | None = None) -> list[Sample]:
    """prompts_per_step x group samples, in arrival order of the prompts."""
    rng = random.Random(f"{data.seed if seed is None else seed}/{data.name}/{step}")
    responses = data.response_lengths or default_response_lengths(data)
    prompts = data.prompt_lengths or default_prompt_lengths(data)
    samples = []
    for p in range(data.prompts_per_step):
        prompt_len = _draw(prompts, data.max_prompt, rng, rng.gauss(0, 1))
        shared = rng.gauss(0, 1)
        for _ in range(data.group):
            samples.append(Sample(p, prompt_len, _draw_correlated(responses, data.max_response, rng, shared)))
    return samples


def _draw_correlated(dist: Call, cap: int, rng: random.Random, shared: float) -> int:
    rho = dist.get("group_corr", 0.0) or 0.0
    z = math.sqrt(rho) * shared + math.sqrt(1 - rho) * rng.gauss(0, 1)
    return _draw(dist, cap, rng, z)


def _draw(dist: Call, cap: int, rng: random.Random, z: float) -> int:
    p = _params(dist)
    if dist.func == "fixed":
        value = p["length"]
    elif dist.func == "uniform":
        value = rng.randint(p["min"], p["max"])
    else:  # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
        sigma = p["sigma"]
        value = math.exp(math.log(p["mean"]) - sigma * sigma / 2 + sigma * z)
    return max(1, min(cap, round(value)))


@functools.lru_cache(maxsize=64)
def _params(dist: Call) -> dict:
    return dict(dist.kwargs)
