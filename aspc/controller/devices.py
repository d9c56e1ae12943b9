"""The learner side's executors in the controller: every forward stage on devices (a reward
model, reference, critic) and the trainer run on executors (config.executors: devices that do
one thing at a time). Each executor takes ready items from one queue in the order they became
ready, and the controller starts an item only on a free executor — so the order of learner
work, the optimizer step and the weight publish are the controller's decisions, and every driver
carries out the same sequence.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from aspc.controller.config import ControllerConfig
from aspc.controller.events import Action, MoveInstance, OptimizerStep, PublishWeights, RunWork, Work


@dataclass(frozen=True)
class Item:
    what: str  # "work" | "optimizer" | "publish" | "move" (a generation instance joins or leaves the trainer)
    work: Work | None = None
    step: int = 0  # the optimizer step, or the version published
    instance: int = -1  # a move's generation instance
    role: str = ""  # a move's new role: "learn" | "gen"

    def action(self, executor: int) -> Action:
        if self.what == "work":
            assert self.work is not None, "a work item without its work"
            return RunWork(self.work, executor)
        if self.what == "optimizer":
            return OptimizerStep(self.step)
        if self.what == "move":
            return MoveInstance(self.instance, self.role)
        return PublishWeights(self.step)


def _step_of(item: Item) -> int:
    """The training step an item serves (an optimizer step, publish or move comes first: submitted first)."""
    return item.work.step if item.work is not None else -1


class DeviceWork:
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.trainer = config.executor_of(config.train_stage)
        self.hosted = [{stage for stage, _ in e.hosts} for e in config.executors]
        self.queue: deque[Item] = deque()
        self.running: list[Item | None] = [None] * len(config.executors)
        self.where: dict[int, int] = {}  # work id -> the executor running it

    def submit(self, item: Item, first: bool = False) -> None:
        if first:
            self.queue.appendleft(item)
        else:
            self.queue.append(item)

    def may_run(self, item: Item, k: int) -> bool:
        if item.what != "work":
            return k == self.trainer
        assert item.work is not None, "a work item without its work"
        return item.work.stage in self.hosted[k]

    def start(self, may_start) -> list:
        """Start the ready item of the oldest step each free executor may run, first come first
        served within a step (`may_start(k)`: its devices are its own now, not generation's). The
        oldest step's work is the critical path: the next optimizer step waits on it, while a
        newer step's reference or reward pass can wait (under staleness 2 it became ready first and
        delayed training)."""
        actions: list[Action] = []
        if not self.queue:
            return actions
        for k, current in enumerate(self.running):
            if current is not None or not may_start(k):
                continue
            ready = [(_step_of(item), i) for i, item in enumerate(self.queue) if self.may_run(item, k)]
            if not ready:
                continue
            position = min(ready)[1]
            item = self.queue[position]
            del self.queue[position]
            self.running[k] = item
            if item.work is not None:
                self.where[item.work.id] = k
            actions.append(item.action(k))
        return actions

    def work_done(self, work_id: int) -> None:
        k = self.where.pop(work_id, None)
        if k is not None:
            self.running[k] = None

    def trainer_done(self, what: str) -> None:
        """The trainer's executor finished its optimizer step, its publish or a move."""
        current = self.running[self.trainer]
        assert current is not None and current.what == what, f"{what} finished, but the trainer ran {current}"
        self.running[self.trainer] = None

    def busy(self, executors: list[int]) -> bool:
        return any(self.running[k] is not None for k in executors)

    def waiting_for(self, executors: list[int]) -> bool:
        """Whether a queued item could run on one of these executors."""
        for item in self.queue:  # loops, not a generator: asked after every event
            for k in executors:
                if self.may_run(item, k):
                    return True
        return False
