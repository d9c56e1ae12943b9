"""The workload model: seeded prompt and response lengths for one training step.

Per-prompt lognormal response lengths, correlated within a prompt's group, truncated at the cap
(the point mass there is the share of responses cut off). A mixture(...) draws each length from one
of its components, chosen by weight per sample, or once per prompt for its whole group (per =
"prompt": hard prompts make the whole group long). Used by the pack pass to choose shape buckets
and by the simulator; deterministic for a data spec, a step and a seed.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from dataclasses import dataclass

from aspc.ir.graph import DataSpec
from aspc.plan.execution_plan import DataPlan
from aspc.ir.values import Call

DEFAULT_SIGMA = 0.8
DEFAULT_GROUP_CORR = 0.5
TWOPI = 2.0 * math.pi


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


def sample_step(data: DataSpec, step: int, seed: int | None = None, prompts_drawn: int | None = None) -> list[Sample]:
    """prompts_per_step x group samples, in arrival order of the prompts. `prompts_drawn`: more
    prompts for the step (dynamic sampling's extra ones; the first prompts_per_step are the same)."""
    prompts, responses = step_lengths(data, step, seed, prompts_drawn)
    return [Sample(k // data.group, prompts[k // data.group], length) for k, length in enumerate(responses)]


def step_lengths(data: DataSpec, step: int, seed: int | None = None,
                 prompts_drawn: int | None = None) -> tuple[list[int], list[int]]:
    """sample_step's lengths without a record per sample (the simulator reads hundreds of
    thousands): (each prompt's length, each sample's response length), sample k of prompt k // group."""
    rng = random.Random(f"{data.seed if seed is None else seed}/{data.name}/{step}")
    responses = grown(data.response_lengths or default_response_lengths(data), step)
    prompts = data.prompt_lengths or default_prompt_lengths(data)
    prompt_lens, response_lens = [], []
    for _ in range(prompts_drawn or data.prompts_per_step):
        prompt_lens.append(_draw(prompts, data.max_prompt, rng, rng.gauss(0, 1)))
        shared = rng.gauss(0, 1)
        response_lens += _group_drawer(_per_prompt(responses, rng), data.max_response)(rng, shared, data.group)
    return prompt_lens, response_lens


@functools.lru_cache(maxsize=256)
def _group_drawer(dist: Call, cap: int):
    """A function (rng, shared, n) -> n lengths: `_draw_correlated` n times, for one distribution
    with its parameters looked up once (a step draws thousands of responses from one
    distribution); the same random numbers, the same lengths."""
    if dist.func != "lognormal":
        return lambda rng, shared, n: [_draw_correlated(dist, cap, rng, shared) for _ in range(n)]
    p = _params(dist)
    rho = dist.get("group_corr", 0.0) or 0.0
    own, common = math.sqrt(1 - rho), math.sqrt(rho)
    sigma = p["sigma"]
    mu = math.log(p["mean"]) - sigma * sigma / 2
    exp = math.exp

    def lognormal(rng: random.Random, shared: float, n: int) -> list[int]:
        common_part = common * shared
        return [max(1, min(cap, round(exp(mu + sigma * (common_part + own * z))))) for z in standard_normals(rng, n)]
    return lognormal


def standard_normals(rng: random.Random, n: int) -> list[float]:
    """`rng.gauss(0, 1)` n times, the same numbers and the same state after (CPython's gauss: the
    Box-Muller pair, its second member kept in `gauss_next` for the next call), without a Python
    call per number: the simulator draws hundreds of thousands."""
    out = []
    z = rng.gauss_next
    rng.gauss_next = None
    if z is not None and n:
        out.append(z)
    elif z is not None:
        rng.gauss_next = z
    random = rng.random
    while len(out) < n:
        x2pi = random() * TWOPI
        g2rad = math.sqrt(-2.0 * math.log(1.0 - random()))
        out.append(math.cos(x2pi) * g2rad)
        if len(out) < n:
            out.append(math.sin(x2pi) * g2rad)
        else:
            rng.gauss_next = math.sin(x2pi) * g2rad
    return out


def grown(dist: Call, step: int) -> Call:
    """The response lengths of `step` under workload drift: a lognormal(..., growth = g) has its
    mean multiplied by (1 + g) ** step (in a mixture, component by component); the cap still holds."""
    if dist.func == "mixture":
        components = tuple(grown(c, step) for c in dist.get("components"))
        return Call("mixture", tuple((k, components if k == "components" else v) for k, v in dist.kwargs))
    growth = dist.get("growth")
    if not growth or not step:
        return dist
    mean = dist.get("mean") * (1 + growth) ** step
    return Call(dist.func, tuple((k, mean if k == "mean" else v) for k, v in dist.kwargs))


def _per_prompt(dist: Call, rng: random.Random) -> Call:
    """The distribution a prompt's group draws from: a per-prompt mixture's component, chosen
    once; anything else unchanged (and no random number taken, so its draws stay as they were)."""
    if dist.func == "mixture" and dist.get("per") == "prompt":
        return _component(dist, rng)
    return dist


def _component(dist: Call, rng: random.Random) -> Call:
    """One component of a mixture, chosen by weight."""
    components, cumulative = _mixture(dist)
    index = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
    return components[min(index, len(components) - 1)]  # a product rounded up to the total


@functools.lru_cache(maxsize=64)
def _mixture(dist: Call) -> tuple[tuple[Call, ...], tuple[float, ...]]:
    return dist.get("components"), tuple(itertools.accumulate(dist.get("weights")))


def _draw_correlated(dist: Call, cap: int, rng: random.Random, shared: float) -> int:
    if dist.func == "mixture":
        dist = _component(dist, rng)
    rho = dist.get("group_corr", 0.0) or 0.0
    z = math.sqrt(rho) * shared + math.sqrt(1 - rho) * rng.gauss(0, 1)
    return _draw(dist, cap, rng, z)


def _draw(dist: Call, cap: int, rng: random.Random, z: float) -> int:
    if dist.func == "mixture":
        dist = _component(dist, rng)
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


def draw_rewards(data: DataSpec | DataPlan, solve_rates: Call, step: int, prompt: int) -> list[float]:
    """A group's verifiable rewards (1 solved, 0 not) for simulating dynamic sampling: the
    prompt's solve rate p is drawn from `solve_rates` (beta(a, b)), each response solves it with
    chance p, so the group is all-equal with chance p^group + (1-p)^group."""
    rng = random.Random(f"{data.seed}/{data.name}/{step}/{prompt}/rewards")
    p = _params(solve_rates)
    rate = rng.betavariate(p["a"], p["b"])
    return [float(rng.random() < rate) for _ in range(data.group)]


# ---- agentic episodes ----------------------------------------------------------------------
DEFAULT_LATENCY = Call("fixed", (("length", 1),))  # seconds of one tool call (schema: tool latency)
DEFAULT_OBSERVATION = Call("fixed", (("length", 64),))  # tokens of one tool result


@dataclass(frozen=True)
class Tool:
    name: str
    latency: Call  # seconds
    timeout: float


@dataclass(frozen=True)
class Environment:
    """What the simulator needs of an environment stage's options."""

    tools: tuple[Tool, ...]
    turns: Call
    observation: Call
    max_turns: int
    max_tool_tokens: int
    workers: int

    @staticmethod
    def of(options: dict) -> Environment:
        tools = tuple(Tool(t.get("name"), t.get("latency") or DEFAULT_LATENCY, float(t.get("timeout", 30.0)))
                      for t in options["tools"])
        turns = options.get("turns") or Call("uniform", (("max", options["max_turns"]), ("min", 1)))
        return Environment(tools, turns, options.get("observation_tokens") or DEFAULT_OBSERVATION,
                           options["max_turns"], options["max_tool_tokens"], options["tool_workers"])


@dataclass(frozen=True)
class EpisodeDraw:
    """One sample's episode as drawn: the model tokens of each turn (they sum to the sample's
    response length), and per tool call between two turns its tool, seconds and observation tokens."""

    turns: tuple[int, ...]
    tools: tuple[int, ...]  # index into Environment.tools
    latencies: tuple[float, ...]  # uncapped: a draw past the tool's timeout is a timed-out call
    observations: tuple[int, ...]


def draw_episode(env: Environment, data: DataSpec | DataPlan, step: int, prompt: int, index: int, response_len: int,
                 seed: int | None = None) -> EpisodeDraw:
    """Deterministic per sample (not per arrival order): T turns from `turns` (at most max_turns and
    the response's tokens), the response split over them at random (each turn one token or more),
    and T - 1 tool calls, each to a tool chosen uniformly from the list."""
    rng = random.Random(f"{data.seed if seed is None else seed}/{data.name}/{step}/episode/{prompt}/{index}")
    count = max(1, min(_draw(env.turns, env.max_turns, rng, rng.gauss(0, 1)), response_len))
    weights = [rng.expovariate(1.0) for _ in range(count)]
    spare, total = response_len - count, sum(weights)
    turns = [1 + math.floor(spare * w / total) for w in weights]
    turns[-1] += response_len - sum(turns)
    tools = tuple(rng.randrange(len(env.tools)) for _ in range(count - 1))
    latencies = tuple(_draw_seconds(env.tools[t].latency, rng) for t in tools)
    observations = tuple(_draw(env.observation, env.max_tool_tokens, rng, rng.gauss(0, 1)) for _ in tools)
    return EpisodeDraw(tuple(turns), tools, latencies, observations)


def _draw_seconds(dist: Call, rng: random.Random) -> float:
    """A duration in seconds: the length distributions without rounding or a cap, or seconds(...)
    (its mean exactly when it has no spread: no random number is drawn)."""
    if dist.func == "seconds":
        mean, sigma = dist.get("mean"), dist.get("sigma") or 0.0
        return mean if sigma == 0 else math.exp(math.log(mean) - sigma * sigma / 2 + sigma * rng.gauss(0, 1))
    p = _params(dist)
    if dist.func == "fixed":
        return float(p["length"])
    if dist.func == "uniform":
        return rng.uniform(p["min"], p["max"])
    sigma = p["sigma"]
    return math.exp(math.log(p["mean"]) - sigma * sigma / 2 + sigma * rng.gauss(0, 1))
