"""A judge's calls carried out under its failure policy (aspc/controller/scoring.py): one call
per sample, at most `concurrency` in flight, each given `timeout_s` from its start. A call that
raises or runs late leaves its sample with the fallback reward, masked; a late call is abandoned
(its thread runs on as a daemon, on a copy of the sample, so it can change nothing).

On virtual time (the deterministic runs of the differential test) a unit is one call, inline."""
from __future__ import annotations

import copy
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from aspc.controller.scoring import CallPolicy, FailureTally

Outcome = str | list[tuple[float, float]]  # the error, or each sample's (reward, task_reward)


class GuardedJudge:
    def __init__(self, judge: Callable[[list], None], stage: str, policy: CallPolicy, clock):
        self.judge, self.policy, self.clock = judge, policy, clock
        self.tally = FailureTally(stage, policy)

    def __call__(self, rollouts: list) -> None:
        if self.clock.virtual:
            self._settle([rollouts], [self._call(rollouts)])
            return
        calls = [[r] for r in rollouts]
        self._settle(calls, self._concurrently(calls))

    def _call(self, rollouts: list) -> Outcome:
        """Judge copies of the rollouts: the (reward, task_reward) of each, or the error."""
        copies = [copy.copy(r) for r in rollouts]
        try:
            self.judge(copies)
        except Exception as error:  # a judge's failure is the sample's, not the run's
            return f"{type(error).__name__}: {error}"
        return [(judged.reward, judged.task_reward) for judged in copies]

    def _concurrently(self, calls: list[list]) -> list[Outcome]:
        outcomes: list[Outcome] = [""] * len(calls)
        pending = deque(range(len(calls)))
        running: dict[int, float] = {}  # call -> when it started
        done: queue.Queue = queue.Queue()
        while pending or running:
            while pending and len(running) < self.policy.concurrency:
                i = pending.popleft()
                running[i] = time.monotonic()
                threading.Thread(target=lambda i=i: done.put((i, self._call(calls[i]))), daemon=True,
                                 name=f"judge call {i}").start()
            deadline = min(running.values()) + self.policy.timeout_s
            try:
                i, outcome = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                i, outcome = min(running, key=lambda j: running[j]), f"timed out after {self.policy.timeout_s:g} s"
            if running.pop(i, None) is not None:  # an abandoned call's late answer is dropped
                outcomes[i] = outcome
        return outcomes

    def _settle(self, calls: list[list], outcomes: list[Outcome]) -> None:
        for rollouts, outcome in zip(calls, outcomes):
            failed = isinstance(outcome, str)
            for k, r in enumerate(rollouts):
                r.masked = failed
                r.reward, r.task_reward = (self.policy.fallback,) * 2 if isinstance(outcome, str) else outcome[k]
            self.tally.record(failed, outcome if isinstance(outcome, str) else "")
