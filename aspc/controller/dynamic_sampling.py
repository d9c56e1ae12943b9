"""DAPO dynamic sampling (`train { filter_groups = true }`): a group whose rewards are all equal
has zero advantage and only dilutes the gradient, so it never reaches the loss; the controller
releases more prompts for the same step until the step has `prompts_per_step` groups that carry
a signal, at most `max_prompts` prompts in all (`max_oversample` x prompts_per_step).

What a step trains does not depend on the schedule: it is the first prompts_per_step prompts *in
release order* whose groups carry a signal (as verl's filter over a generated batch), never the
first to finish — taking the first finished would drop the long responses and bias the policy
towards short ones. A group with a signal is admitted as soon as no group before it can push it
out of the batch (every group among the first prompts_per_step at once), so units still stream.

Decisions, per step:
- a step opens with prompts_per_step / (the keep rate seen so far) prompts, so the expected
  filtering is generated in the same wave rather than in rounds after it;
- after each scored group, prompts are topped up until the pending groups are expected to fill
  the step (`ceil(need / keep_rate) - pending`), within the bound;
- a full step cancels its prompts still queued (all after its last admitted one), and samples of
  the step that finish later are dropped; a step that reached the bound with every group scored
  is completed with its first all-equal groups (`padded`), so every step trains a full batch, and
  the run log says so (PaddingWarnings); or, with `at_oversample_bound = stop`, the run ends with
  OversampleBoundReached, as verl's raises once it generated max_num_gen_batches batches.

Pure bookkeeping: the controller asks and acts (aspc/controller/core.py); the drivers report the
rewards of each scoring (`WorkFinished.rewards`).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

Group = tuple[int, int]  # (step, prompt)
STOP_ADVICE = ("Raise max_oversample, check the reward and the prompts' difficulty (a group whose responses all "
               "get one reward carries no signal), or set at_oversample_bound = pad to complete such steps with "
               "all-equal groups")
PAD_ADVICE = ("Raise max_oversample, check the reward, or set at_oversample_bound = stop to end the run at such "
              "a step (as verl does)")


class OversampleBoundReached(Exception):
    """at_oversample_bound = stop: a step generated max_oversample x prompts_per_step prompts
    without prompts_per_step groups with a signal; the run ends (a user error, said with what to do)."""


@dataclass
class StepGroups:
    released: int  # prompts released for the step (indices 0 .. released-1)
    signal: set[int] = field(default_factory=set)  # scored: rewards not all equal
    uniform: set[int] = field(default_factory=set)  # scored: all equal
    admitted: list[int] = field(default_factory=list)  # to training, in the order admitted
    cancelled: list[int] = field(default_factory=list)  # released, never generated
    padded: list[int] = field(default_factory=list)  # all-equal groups admitted at the bound
    full: bool = False  # its batch is complete: nothing more of the step is trained
    closed: bool = False  # its queued prompts are cancelled

    @property
    def decided(self) -> int:
        return len(self.signal) + len(self.uniform)

    @property
    def generated(self) -> int:
        return self.released - len(self.cancelled)


class GroupFilter:
    def __init__(self, prompts_per_step: int, group: int, max_prompts: int, stop_at_bound: bool = False):
        self.prompts, self.group, self.max_prompts = prompts_per_step, group, max_prompts
        self.stop_at_bound = stop_at_bound  # at_oversample_bound = stop: `padding` raises instead
        self.steps: dict[int, StepGroups] = {}
        self.rewards: dict[Group, dict[int, float | None]] = defaultdict(dict)  # summed over reward stages
        self.with_signal = 0  # groups scored with unequal rewards, over the run
        self.scored = 0

    # -- how many prompts --
    def keep_rate(self) -> float:
        """The share of groups with a signal seen so far (1 before any: no oversampling yet)."""
        return (self.with_signal + 1) / (self.scored + 1)

    def opening(self, step: int) -> int:
        """Prompts to release when the step opens."""
        count = min(self.max_prompts, math.ceil(self.prompts / self.keep_rate() - 1e-9))
        self.steps[step] = StepGroups(count)
        return count

    def top_up(self, step: int) -> range:
        """New prompt indices to release for the step (empty when none are needed or allowed)."""
        s = self.steps[step]
        need = self.prompts - len(s.signal)
        pending = s.generated - s.decided
        want = math.ceil(need / self.keep_rate() - 1e-9) - pending if need > 0 and not s.full else 0
        count = max(0, min(want, self.max_prompts - s.released))
        s.released += count
        return range(s.released - count, s.released)

    # -- scoring --
    def add_rewards(self, samples: tuple, rewards: tuple) -> None:
        """A reward stage's scores of a group's samples (None: a masked sample, no score)."""
        for (step, prompt, index), reward in zip(samples, rewards):
            scores = self.rewards[(step, prompt)]
            if reward is None or scores.get(index, 0.0) is None:
                scores[index] = None
            else:
                scores[index] = scores.get(index, 0.0) + reward

    def decide(self, step: int, prompt: int) -> None:
        """Record a scored group: with a signal, or all-equal (fewer than two scores: no signal either)."""
        scores = [r for r in self.rewards.pop((step, prompt), {}).values() if r is not None]
        uniform = len(set(scores)) < 2
        self.scored += 1
        self.with_signal += not uniform
        s = self.steps[step]
        if not s.full:
            (s.uniform if uniform else s.signal).add(prompt)

    def admissible(self, step: int) -> list[int]:
        """Groups with a signal that are now sure to be in the step's batch (admitted by this
        call); the step is full once its first prompts_per_step such groups are all admitted."""
        s = self.steps[step]
        new, could = [], 0  # could: earlier groups that have, or may yet have, a signal
        for prompt in range(s.released):
            if could >= self.prompts:
                break
            if prompt in s.signal and prompt not in s.admitted:
                new.append(prompt)
            could += prompt not in s.uniform
        s.admitted += new
        s.full = s.full or len(s.admitted) >= self.prompts
        return new

    def padding(self, step: int) -> list[int]:
        """A step at the bound with every group scored: its first all-equal groups complete it, or
        (stop_at_bound) OversampleBoundReached ends the run."""
        s = self.steps[step]
        if s.full or s.released < self.max_prompts or s.generated > s.decided:
            return []
        if self.stop_at_bound:
            raise OversampleBoundReached(f"{self.at_bound(step)}; at_oversample_bound = stop ends the run here, as "
                                         f"verl's DAPO trainer does at max_num_gen_batches. {STOP_ADVICE}")
        take = sorted(s.uniform)[:self.prompts - len(s.admitted)]
        s.padded += take
        s.admitted += take
        s.full = True
        return take

    def at_bound(self, step: int) -> str:
        """What a step at its bound lacks, in words (for the error and the warning)."""
        s = self.steps[step]
        return (f"step {step + 1} reached the dynamic sampling bound: it generated {s.generated} prompts "
                f"(max_oversample x prompts_per_step) and only {len(s.signal)} of their groups had rewards that "
                f"differ, of the {self.prompts} a step trains")

    def full(self, step: int) -> bool:
        s = self.steps.get(step)
        return s is not None and s.full

    def close(self, step: int, cancelled: list[int]) -> None:
        """The full step's queued prompts were cancelled."""
        s = self.steps[step]
        s.cancelled += cancelled
        s.closed = True

    # -- what reports read --
    def metrics(self, step: int) -> dict:
        s = self.steps.get(step)
        if s is None:
            return {}
        return {"oversample": round(s.generated / self.prompts, 4), "filtered_groups": len(s.uniform) - len(s.padded),
                "padded_groups": len(s.padded)}


class PaddingWarnings:
    """The run log's word on steps padded at the bound: the first in full, then a count at the 2nd,
    4th, 8th ... such step (a run that pads every step gets a few lines, not one a step)."""

    def __init__(self, warn: Callable[[str], None]):
        self.warn, self.padded_steps = warn, 0

    def record(self, groups: GroupFilter, step: int) -> None:
        s = groups.steps.get(step)
        if s is None or not s.padded:
            return
        self.padded_steps += 1
        if self.padded_steps == 1:
            self.warn(f"warning: {groups.at_bound(step)}; {len(s.padded)} all-equal groups completed it "
                      f"(padded_groups), and they teach nothing. {PAD_ADVICE}")
        elif self.padded_steps & (self.padded_steps - 1) == 0:  # a power of two
            self.warn(f"warning: {self.padded_steps} steps so far were completed with all-equal groups at the "
                      f"max_oversample bound (step {step + 1}: {len(s.padded)} of {groups.prompts})")
