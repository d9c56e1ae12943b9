"""The training side of the controller: finished samples become streamed units (whole groups),
each unit runs the forward stages (reward, reference, critic) and then training; a step's
optimizer update follows its last unit.

A reward model or judge on devices of its own scores each group as soon as it is complete
(score-as-finished), not per unit: its pool works while generation goes on, and a unit's
training waits only for the scores of its groups."""
from __future__ import annotations

from collections import defaultdict, deque

from aspc.controller.config import ControllerConfig
from aspc.controller.events import SampleId, Work


class Learner:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.group_done: dict[tuple[int, int], int] = defaultdict(int)
        self.ready_groups: dict[int, list[int]] = defaultdict(list)  # step -> completed prompts
        self.grouped: dict[int, int] = defaultdict(int)  # step -> samples put into units
        self.grouped_total = 0  # samples put into units, all steps
        self.work: dict[int, Work] = {}
        self.forward_left: dict[int, int] = {}  # train unit id -> forward works still running
        self.unit_of: dict[int, int] = {}  # forward work id -> its train unit id
        self.train_ready: dict[int, deque] = defaultdict(deque)
        self.train_left: dict[int, int] = defaultdict(int)  # step -> train works not finished
        self.trained: dict[int, int] = defaultdict(int)  # step -> samples trained
        self.scores_left: dict[tuple[int, int], int] = {}  # group -> per-group scorings still running
        self.group_of: dict[int, tuple[int, int]] = {}  # per-group scoring work id -> its group
        self.waiting: dict[tuple[int, int], list[int]] = defaultdict(list)  # group -> train units waiting
        self.scored: list[tuple[int, int]] = []  # dynamic sampling: groups scored, for the filter to decide
        self.next_id = 0

    def sample_done(self, sample: SampleId) -> list[Work]:
        """Forward works for the units this sample completes."""
        return self.samples_done((sample,))

    def samples_done(self, samples) -> list[Work]:
        """sample_done of each, in order (a decode step's finishes: one call, not one per sample)."""
        group_done, group, works = self.group_done, self.config.group, []
        for step, prompt, _ in samples:
            done = group_done[step, prompt] = group_done[step, prompt] + 1
            if done == group:  # a group's last sample forms units; the rest change nothing
                works += self._group_complete(step, prompt)
        return works

    def _group_complete(self, step: int, prompt: int) -> list[Work]:
        if not self.config.filters_groups:  # filtered: it waits for its scores and the filter's word
            self.ready_groups[step].append(prompt)
        return self._score_group(step, prompt) + self._form_units(step)

    def admit(self, step: int, prompt: int) -> list[Work]:
        """Dynamic sampling: a scored group the filter keeps joins the step's units."""
        self.ready_groups[step].append(prompt)
        return self._form_units(step)

    def _score_group(self, step: int, prompt: int) -> list[Work]:
        scorers = [s for s in self.config.forward_stages if s.per_group]
        if not scorers:
            return []
        samples = tuple([(step, prompt, g) for g in range(self.config.group)])
        works = [self._new(s.name, s.kind, step, samples) for s in scorers]
        self.scores_left[(step, prompt)] = len(works)
        self.group_of.update((w.id, (step, prompt)) for w in works)
        return works

    def _form_units(self, step: int) -> list[Work]:
        c = self.config
        ready = self.ready_groups[step]
        step_complete = self.grouped[step] + len(ready) * c.group == c.samples_per_step
        size = c.stream_micro or c.samples_per_step
        works = []
        while ready and (len(ready) * c.group >= size or step_complete):
            take = max(1, size // c.group)
            prompts, ready[:] = ready[:take], ready[take:]
            samples = tuple([(step, p, g) for p in prompts for g in range(c.group)])
            self.grouped[step] += len(samples)
            self.grouped_total += len(samples)
            works += self._unit(step, samples)
        return works

    def _unit(self, step: int, samples: tuple) -> list[Work]:
        train = self._new(self.config.train_stage, "train", step, samples)
        forward = [self._new(s.name, s.kind, step, samples) for s in self.config.forward_stages if not s.per_group]
        unscored = sorted({(step, p) for _, p, _ in samples if (step, p) in self.scores_left})
        self.forward_left[train.id] = len(forward) + len(unscored)
        self.train_left[step] += 1
        for work in forward:
            self.unit_of[work.id] = train.id
        for group in unscored:
            self.waiting[group].append(train.id)
        if not self.forward_left[train.id]:
            self.train_ready[step].append(train)
        return forward

    def _new(self, stage: str, kind: str, step: int, samples: tuple) -> Work:
        work = Work(self.next_id, stage, kind, step, samples)
        self.work[work.id] = work
        self.next_id += 1
        return work

    def work_done(self, work_id: int) -> int | None:
        """Record a finished work; returns the step whose optimizer update may now run, if any."""
        work = self.work.pop(work_id, None)
        if work is None:
            return None
        if work_id in self.group_of:
            group = self.group_of.pop(work_id)
            self.scores_left[group] -= 1
            if self.scores_left[group] == 0:
                del self.scores_left[group]
                if self.config.filters_groups:
                    self.scored.append(group)
                for unit in self.waiting.pop(group, []):
                    self._forward_done(unit)
            return None
        if work.kind != "train":
            self._forward_done(self.unit_of.pop(work_id))
            return None
        self.train_left[work.step] -= 1
        self.trained[work.step] += len(work.samples)
        if self.trained[work.step] == self.config.samples_per_step and self.train_left[work.step] == 0:
            return work.step
        return None

    def _forward_done(self, unit: int) -> None:
        self.forward_left[unit] -= 1
        if self.forward_left[unit] == 0:
            train = self.work[unit]
            self.train_ready[train.step].append(train)

    def runnable_train(self, version: int) -> list[Work]:
        """Train works of the step whose weights are current (training is in step order); with
        `train_whole_step`, only once every unit of the step is ready (config.whitens_over_step)."""
        queue = self.train_ready[version]
        if not queue or (self.config.train_whole_step and not self._every_unit_ready(version)):
            return []
        works = list(queue)
        queue.clear()
        return works

    def _every_unit_ready(self, step: int) -> bool:
        """Every sample of the step is in a unit, and every unit waits in the train queue."""
        return (self.grouped[step] == self.config.samples_per_step
                and len(self.train_ready[step]) == self.train_left[step])
