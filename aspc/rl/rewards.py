"""Reward functions: built-in rules, and user callables "module:function".

A user reward is called as function(prompt: str, response: str, answer: str | None, metadata: dict)
and returns a finite number. Whatever else it does stops the run with one message (a RewardError,
or a NonFiniteError, a ValueError) that names the function and the sample, before any weight
changes; the run keeps its last checkpoint (--resume continues from it):

- it raises: the exception is reported with the sample;
- it returns NaN or an infinity: a reward must be finite (a NaN would turn every weight into NaN);
- it raises SystemExit or GeneratorExit (a BaseException that ends no run): reported as an error,
  never taken as the run's exit (a KeyboardInterrupt passes through: it is the user's Ctrl-C);
- it runs past its timeout: REWARD_TIMEOUT_S (30 s) per call, or the seconds in the environment
  variable ASPC_REWARD_TIMEOUT (0: no limit). Each call runs on a thread of its own; a thread
  cannot be killed, so a call past its limit is abandoned, its daemon thread left running until
  the process ends, and the run stops with the function's name and the limit. The run stops rather
  than mask the sample: a python(...) source has no fallback reward (the judge's masked-sample
  policy, aspc/controller/scoring.py, is for judge calls; a python(...) term of a judge's stage
  fails as its call does), and a hang is a bug in the function that would recur on every sample.
"""
from __future__ import annotations

import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from aspc.rl.losses import NonFiniteError
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


REWARD_TIMEOUT_S = 30.0  # seconds a user reward function may take per call
TIMEOUT_ENV = "ASPC_REWARD_TIMEOUT"  # overrides it, in seconds; 0: no limit


class RewardError(Exception):
    """A reward function failed on a sample (the message names the sample)."""


class RewardTimeout(Exception):
    """A user reward function ran past its time limit (its call is abandoned)."""

    def __init__(self, timeout_s: float):
        super().__init__(f"it ran past its {timeout_s:g} s limit (the call is abandoned, its thread left "
                         f"running); make it return sooner, or raise the limit with {TIMEOUT_ENV}=SECONDS "
                         "(0: no limit)")


class RewardExit(Exception):
    """A user reward function raised SystemExit or another BaseException that is not Ctrl-C."""

    def __init__(self, error: BaseException):
        super().__init__(f"it raised {type(error).__name__}({error}), which does not end the run: a reward "
                         "must return a number (raise an ordinary exception to report a problem)")


@dataclass(frozen=True)
class WeightedReward:
    sources: tuple  # (callable, weight)

    def __call__(self, prompt: str, response: str, answer: str | None, metadata: dict) -> float:
        total = 0.0
        for function, weight in self.sources:
            total += weight * score_one(function, (prompt, response, answer, metadata))
        return total


def score_one(function: Callable, args: tuple, source: str | None = None) -> float:
    """`function(*args)` (prompt, response text, answer, metadata) as a float; RewardError if it
    fails, NonFiniteError if it is NaN or infinite, each naming the source and the sample."""
    source = source or source_name(function)
    try:
        value = float(function(*args))
    except Exception as error:  # a user's function: report it with the sample
        raise RewardError(f"reward {source} failed on {sample_text(args[0], args[1])}: {describe(error)}") from None
    if not math.isfinite(value):
        raise non_finite_reward(value, source, sample_text(args[0], args[1]))
    return value


def non_finite_reward(value: float, source: str, sample: str) -> NonFiniteError:
    """The error of a reward source that scored `sample` NaN or infinite."""
    return NonFiniteError(f"reward {source} returned {value} on {sample}: a reward must be a finite number, "
                          "and training on it would make every weight NaN; no weight was changed. Make it "
                          "return a finite score (e.g. 0.0 for a response it cannot score)")


def source_name(function: Callable) -> str:
    """How the pipeline names a reward function: python("module:function") or rule("name")."""
    if isinstance(function, _UserFunction):
        return f'python("{function.spec}")'
    name = getattr(function, "__name__", str(function))
    return f'rule("{name}")' if RULES.get(name) is function else name


def sample_text(prompt: str, response: str) -> str:
    return f"prompt {prompt!r}, response {response!r}"


def describe(error: Exception) -> str:
    if isinstance(error, (RewardTimeout, RewardExit)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def reward_timeout_s() -> float | None:
    """The time limit of one user reward call: ASPC_REWARD_TIMEOUT, else REWARD_TIMEOUT_S; None: none."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return REWARD_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        raise RewardError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds; set it to e.g. 30, "
                          "or 0 for no limit") from None
    return seconds if seconds > 0 else None


def call_with_timeout(function: Callable, args: tuple, timeout_s: float | None):
    """`function(*args)` on a daemon thread of its own, waited for at most `timeout_s` seconds:
    its value, or its exception re-raised here; RewardTimeout when it runs late (the thread is
    abandoned: a thread cannot be killed), RewardExit for SystemExit, GeneratorExit and the like."""
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as error:  # the caller decides; nothing may end this thread silently
            outcome["error"] = error

    thread = threading.Thread(target=call, daemon=True, name=f"reward {getattr(function, '__name__', '')}")
    thread.start()
    thread.join(timeout_s)
    if timeout_s is not None and thread.is_alive():  # without a limit, join returns when the call ends
        raise RewardTimeout(timeout_s)
    error = outcome.get("error")
    if error is None:
        return outcome["value"]
    if isinstance(error, (Exception, KeyboardInterrupt)):
        raise error
    raise RewardExit(error)


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
        return call_with_timeout(self.function, args, reward_timeout_s())

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
