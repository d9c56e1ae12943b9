"""The environment's tool runners as a resource of the controller: `tool_workers` of them, shared
by every generation instance. A tool call waits in FIFO order for a free runner (the lowest
numbered first), so the same calls start in the same order under every driver."""
from __future__ import annotations

import heapq
from collections import deque

from aspc.controller.events import RunTool, SampleId


class ToolRunners:
    def __init__(self, workers: int):
        self.free = list(range(workers))
        self.waiting: deque[tuple[SampleId, int]] = deque()  # (sample, instance holding it)
        self.running: dict[int, tuple[SampleId, int] | None] = {}  # runner -> its call (None: orphaned)

    def submit(self, sample: SampleId, instance: int) -> None:
        self.waiting.append((sample, instance))

    def start(self) -> list[RunTool]:
        actions = []
        while self.waiting and self.free:
            runner = heapq.heappop(self.free)
            call = self.running[runner] = self.waiting.popleft()
            actions.append(RunTool(call[0], runner))
        return actions

    def done(self, runner: int) -> tuple[SampleId, int] | None:
        """The call that ended, or None when its instance failed meanwhile (the result is dropped)."""
        heapq.heappush(self.free, runner)
        return self.running.pop(runner)

    def forget(self, instance: int) -> None:
        """A failed instance's episodes are redone from the start: drop their calls."""
        self.waiting = deque(c for c in self.waiting if c[1] != instance)
        for runner, call in self.running.items():
            if call is not None and call[1] == instance:
                self.running[runner] = None

    @property
    def queued(self) -> int:
        return len(self.waiting)
