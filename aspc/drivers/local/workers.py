"""The threads of the local runtime: one per generation instance, one for the learner. Each reads
its inbox, does the work on the CPU backend and posts events for the controller."""
from __future__ import annotations

import queue
import threading
import time
import traceback

from aspc.controller.events import (InstanceFailed, InstanceRecovered, SampleFinished, WeightsLoaded,
                                    WeightsPublished, WorkFinished)
from aspc.accounting.trace import Span


class WorkerFailed(Exception):
    """A worker thread raised; the message names the worker and the error."""


class Worker(threading.Thread):
    def __init__(self, name: str, events: queue.Queue, clock):
        super().__init__(name=name, daemon=True)
        self.inbox: queue.Queue = queue.Queue()
        self.events, self.clock = events, clock
        self.spans: list[Span] = []
        self.stopping = threading.Event()
        self.setup = None  # called on the worker's own thread first: sets its torch thread count
        self.torch_threads = None  # what setup returned

    def run(self) -> None:
        try:
            if self.setup is not None:
                self.torch_threads = self.setup()
            self.loop()
        except Exception as error:  # reported to the main loop, which ends the run cleanly
            self.events.put(("error", self.name, error, traceback.format_exc()))

    def span(self, start: float, category: str, label: str) -> None:
        self.spans.append(Span(self.name, start, self.clock(), category, label))


class InstanceLost(Exception):
    """The process behind a generation instance died (a remote runtime's worker)."""


class GenerationWorker(Worker):
    def __init__(self, index: int, generator, weights: dict, results: dict, lock, events, clock):
        super().__init__(f"gen[{index}]", events, clock)
        self.index, self.generator, self.weights, self.results, self.lock = index, generator, weights, results, lock

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                message = self.inbox.get(timeout=None if self.generator.busy else 0.05) \
                    if not self.generator.busy else self.inbox.get_nowait()
            except queue.Empty:
                message = None
            if message is not None:
                self.handle(message)
                continue
            if self.generator.busy:
                start = self.clock()
                try:
                    finished = self.generator.step()
                except InstanceLost:
                    self.events.put(InstanceFailed(self.index))
                    continue
                self.span(start, "useful", "decode")
                for f in finished:
                    with self.lock:
                        self.results[f.key] = f
                    self.events.put(SampleFinished(f.key, self.index, len(f.response)))

    def handle(self, message) -> None:
        kind, payload = message
        if kind == "requests":
            for key, ids, seed in payload:
                self.generator.add(key, ids, seed)
        elif kind == "replace":  # a restarted instance: a new generator, then the controller is told
            self.generator = payload
            self.events.put(InstanceRecovered(self.index))
        elif kind == "sync":
            start = self.clock()
            try:
                self.generator.load_weights(self.weights[payload])
            except InstanceLost:
                self.events.put(InstanceFailed(self.index))
                return
            self.span(start, "sync", f"load v{payload}")
            self.events.put(WeightsLoaded(self.index, payload))
        elif kind == "stop":
            self.stopping.set()


class LearnerWorker(Worker):
    """Runs learner work in order; after each optimizer step it publishes the new weights. A
    ("checkpoint", version) message writes a checkpoint (`checkpoint(version)`): the controller
    asks for it after the step's metrics are recorded, and nothing changes the weights between."""

    def __init__(self, learner, rollouts, weights: dict, metrics: dict, events, clock, checkpoint=None):
        super().__init__("learner", events, clock)
        self.learner, self.rollouts, self.weights, self.metrics = learner, rollouts, weights, metrics
        self.checkpoint = checkpoint
        self.trained: dict[int, list] = {}  # step -> sample ids trained in it
        self.completed = None  # the last version published
        self.saved = None  # the last version checkpointed

    def loop(self) -> None:
        while True:
            kind, payload = self.inbox.get()
            if kind == "stop" or self.stopping.is_set():  # stopping: interrupted, drop queued work
                return
            start = self.clock()
            if kind == "checkpoint":
                self.save(payload)
            elif kind == "work":
                getattr(self.learner, _METHODS[payload.kind])(self.rollouts(sorted(payload.samples)))
                if payload.kind == "train":
                    self.trained.setdefault(payload.step, []).extend(payload.samples)
                self.span(start, "useful", f"{payload.kind} step {payload.step}")
                self.events.put(WorkFinished(payload.id))
            else:  # optimizer step: publish version step + 1
                self.metrics[payload] = self.learner.optimizer_step()
                self.metrics[payload]["trained"] = sorted(self.trained.pop(payload, []))
                self.weights[payload + 1] = self.learner.snapshot()
                self.completed = payload + 1
                self.span(start, "useful", f"optimizer step {payload}")
                self.events.put(WeightsPublished(payload + 1))

    def save(self, version: int) -> None:
        if self.checkpoint is None:
            return
        assert version == self.completed, f"checkpoint of step {version} asked at step {self.completed}"
        self.checkpoint(version)
        self.saved = version


_METHODS = {"reward": "reward", "reference": "reference", "critic": "values", "train": "train"}


class Clock:
    """Seconds since the clock was started or last reset (the RL phase starts at a reset)."""

    def __init__(self):
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin

    def reset(self) -> None:
        self.origin = time.perf_counter()

