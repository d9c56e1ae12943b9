"""The threads of the local runtime: one per generation instance and one per learner-side
executor (the trainer's devices; a reward model's instances). Each reads its inbox, does what
the controller asked through the executor roles (aspc/roles.py) and posts the events that say
it is done. Workers decide nothing: the order of everything they do is the controller's."""
from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable

from aspc.accounting.trace import Span
from aspc.controller.events import (InstanceFailed, InstanceMoved, InstanceRecovered, OptimizerDone, PoolSwitched,
                                    SampleFinished, SamplesFinished, ToolCalled, ToolReturned, WeightsLoaded,
                                    WeightsPublished, WorkFinished)
from aspc.ir.kinds import kind_rule


class WorkerFailed(Exception):
    """A worker thread raised; the message names the worker and the error."""


class Worker(threading.Thread):
    def __init__(self, name: str, events: queue.Queue, clock):
        """`clock`: the run's time (virtual_time.RealTime, or VirtualTime for a deterministic run),
        which also makes the inbox."""
        super().__init__(name=name, daemon=True)
        self.inbox = clock.queue()
        self.events, self.clock = events, clock
        self.spans: list[Span] = []
        self.stopping = threading.Event()
        # called on the worker's own thread first: sets its torch thread count
        self.setup: Callable[[], object] | None = None
        self.torch_threads: object = None  # what setup returned
        self.error: Exception | None = None  # what ended the thread, also reported as an event

    def run(self) -> None:
        try:
            if self.setup is not None:
                self.torch_threads = self.setup()
            self.loop()
        except Exception as error:  # reported to the main loop, which ends the run cleanly
            self.error = error
            self.events.put(("error", self.name, error, traceback.format_exc()))
        finally:
            self.clock.leave()

    def loop(self) -> None:
        """The worker's work until it is stopped: each kind of worker has its own."""
        raise NotImplementedError

    def span(self, start: float, category: str, label: str) -> None:
        self.spans.append(Span(self.name, start, self.clock(), category, label))


class InstanceLost(Exception):
    """The process behind a worker died (a generation instance's or the learner's process, a remote
    runtime's actor); the message names it."""


class GenerationWorker(Worker):
    """One generation instance. Agentic episodes: a turn that ends in a tool call is reported
    (ToolCalled, the call kept in `calls` for the tool runner) and its sequence waits in the engine
    for a ("resume", ...) message; time the instance spends with nothing to decode while episodes
    wait on tools is recorded as tool_wait."""

    def __init__(self, index: int, generator, weights: dict, results: dict, lock, events, clock,
                 calls: dict | None = None):
        super().__init__(f"gen[{index}]", events, clock)
        self.index, self.generator, self.weights, self.results, self.lock = index, generator, weights, results, lock
        self.calls = calls if calls is not None else {}
        self.lost: str | None = None  # why its process died (InstanceLost's message), for the run's error
        # its pool is the learner's (a time-shared pool's carry-over): what is in flight waits, no decode step
        self.suspended = False

    def loop(self) -> None:
        while not self.stopping.is_set():
            decoding = self.generator.busy and not self.suspended
            try:  # decoding: take what came in between two decode steps; otherwise wait for a message
                message = self.inbox.get_nowait() if decoding else self._wait()
            except queue.Empty:
                message = None
            if message is not None:
                self.handle(message)
                continue
            if decoding:
                start = self.clock()
                try:
                    finished = self.generator.step()
                except InstanceLost as error:
                    self._lost(error)
                    continue
                self.span(start, "useful", "decode")
                self._report(finished)

    def _lost(self, error: InstanceLost) -> None:
        self.lost = str(error)
        self.events.put(InstanceFailed(self.index))

    def _wait(self):
        """Block for the next message; idle while episodes wait on their tools is tool_wait."""
        if not getattr(self.generator, "held", None):
            return self.inbox.get()
        start = self.clock()
        message = self.inbox.get()
        if self.clock() > start:
            self.span(start, "tool_wait", "idle: every episode waits on a tool")
        return message

    def _report(self, finished) -> None:
        """Finished samples first, then the turns that ended in a tool call (the simulator's order)."""
        reports = []
        for f in finished:
            with self.lock:
                self.results[f.key] = f
            mask, episode = getattr(f, "mask", None), getattr(f, "episode", None)
            model_tokens = sum(mask) if mask else len(f.response)
            reports.append(SampleFinished(f.key, self.index, model_tokens, episode["turns"] if episode else 1))
        if reports:  # one event per decode step, as the simulator reports an instant's finishes
            self.events.put(SamplesFinished(self.index, tuple(reports)))
        for c in self.generator.pop_calls() if hasattr(self.generator, "pop_calls") else ():
            with self.lock:
                self.calls[c.key] = c.call
            self.events.put(ToolCalled(c.key, self.index, c.context, c.turns, c.generated))

    def handle(self, message) -> None:
        kind, payload = message
        if kind == "requests":
            for key, ids, seed in payload:
                self.generator.add(key, ids, seed)
        elif kind == "resume":  # (sample, tool result): its next turn here, or its end
            self._report(self.generator.resume(*payload))
        elif kind == "move":  # (sample, tool result, the instance it goes on on)
            key, result, target = payload
            target.inbox.put(("adopt", (self.generator.detach(key), result)))
        elif kind == "adopt":
            self._report(self.generator.adopt(*payload))
        elif kind == "replace":  # a restarted instance: a new generator, then the controller is told
            self.generator, self.lost = payload, None
            self.events.put(InstanceRecovered(self.index))
        elif kind == "sync":
            start = self.clock()
            try:
                self.generator.load_weights(self.weights[payload])
            except InstanceLost as error:
                self._lost(error)
                return
            self.span(start, "sync", f"load v{payload}")
            self.events.put(WeightsLoaded(self.index, payload))
        elif kind == "suspend":  # the time-shared pool goes to the learner with requests in flight
            self.suspended = True
        elif kind == "wake":  # the pool is back (the weight sync that carries them on is ahead in the inbox)
            self.suspended = False
        elif kind == "stop":
            self.stopping.set()


class ToolWorker(Worker):
    """One of the environment's tool runners: runs the calls the controller hands it, one at a time."""

    def __init__(self, index: int, tools, calls: dict, results: dict, lock, events, clock, health=None):
        """`health`: the run's ToolHealth (aspc/controller/health.py): it warns about, and stops, a
        tool that fails every call."""
        super().__init__(f"tools[{index}]", events, clock)
        self.index, self.tools, self.calls, self.results, self.lock = index, tools, calls, results, lock
        self.health = health

    def loop(self) -> None:
        while True:
            kind, sample = self.inbox.get()
            if kind == "stop" or self.stopping.is_set():
                return
            with self.lock:
                call = self.calls.pop(sample)
            start = self.clock()
            try:
                result = self.tools.run(call)
            except Exception as error:  # the runner itself broke: an infrastructure failure, masked
                result = _Crashed(f"{type(error).__name__}: {error}")
            self.span(start, "tool", f"{call.tool} (sample {'/'.join(map(str, sample))})")
            with self.lock:
                self.results[sample] = result
            self.events.put(ToolReturned(sample, self.index, result.status))
            if self.health is not None:  # after the event: a stopping run still has this call's episode
                self.health.record(call.tool, result.status, result.observation)


class _Crashed:
    status = "crashed"

    def __init__(self, observation: str):
        self.observation = observation


class ExecutorWorker(Worker):
    """One learner-side executor: runs learner work in the order the controller hands it out.

    `runners[stage]` runs a stage's streamed unit (the trainer's reference, critic and train
    passes; a forward model's scoring); a time-shared one switches its pool. The trainer's executor
    (`trainer` given) also runs the optimizer step, publishes the new weights and writes
    checkpoints: a ("checkpoint", version) message writes one (`checkpoint(version)`) — the
    controller asks for it after the step's metrics are recorded, and nothing changes the
    weights between."""

    def __init__(self, name: str, runners: dict, rollouts, events, clock, trainer=None, weights=None,
                 metrics=None, checkpoint=None, switch=None):
        super().__init__(name, events, clock)
        self.runners, self.rollouts = runners, rollouts
        self.learner, self.weights, self.metrics = trainer, weights, metrics
        self.checkpoint, self.switch = checkpoint, switch
        self.trained: dict[int, list] = {}  # step -> sample ids trained in it
        self.completed: int | None = None  # the last version published
        self.stepped: int | None = None  # the version the trainer's weights are at (its last optimizer step's)
        self.report_rewards = False  # dynamic sampling: WorkFinished carries a reward work's scores
        self.saved: int | None = None  # the last version checkpointed
        self.save_seconds: list[float] = []  # how long each checkpoint since the last metrics row took
        # runtime rebalancing: move(instance, role) carries a move out on the trainer's devices
        self.move: Callable[[int, str], None] | None = None

    def loop(self) -> None:
        while True:
            kind, payload = self.inbox.get()
            if kind == "stop" or self.stopping.is_set():  # stopping: interrupted, drop queued work
                return
            start = self.clock()
            if kind == "checkpoint":
                self.save(payload)
            elif kind == "work":
                rollouts = self.rollouts(sorted(payload.samples))
                self.runners[payload.stage](rollouts)
                if payload.kind == "train":
                    self.trained.setdefault(payload.step, []).extend(payload.samples)
                self.span(start, "useful", f"{payload.kind} step {payload.step}")
                scores = reward_scores(payload, rollouts) if self.report_rewards and payload.kind == "reward" else None
                self.events.put(WorkFinished(payload.id, scores))
            elif kind == "optimizer":
                self.metrics[payload] = self.learner.optimizer_step()
                self.metrics[payload]["trained"] = sorted(self.trained.pop(payload, []))
                self.stepped = payload + 1
                self.span(start, "useful", f"optimizer step {payload}")
                self.events.put(OptimizerDone(payload))
            elif kind == "publish":
                self.weights[payload] = self.learner.snapshot()
                self.completed = payload
                self.span(start, "sync", f"publish v{payload}")
                self.events.put(WeightsPublished(payload))
            elif kind == "move":  # (instance, role): a generation instance joins or leaves the trainer
                assert self.move is not None, "a move asked of a runtime without rebalancing"
                self.move(*payload)
                self.span(start, "sync", f"move gen[{payload[0]}] to {payload[1]}")
                self.events.put(InstanceMoved(*payload))
            else:  # ("switch", (pool, mode)): the time-shared pool changes hands
                self.switch(*payload)
                self.span(start, "sync", f"switch to {payload[1]}")
                self.events.put(PoolSwitched(*payload))

    def save(self, version: int) -> None:
        if self.checkpoint is None:
            return
        assert version == self.completed, f"checkpoint of step {version} asked at step {self.completed}"
        start = self.clock()
        self.checkpoint(version)
        self.saved = version
        self.save_seconds.append(self.clock() - start)

    def take_save_seconds(self) -> float:
        """Seconds the checkpoints written since the last call took (the learner could not train)."""
        taken = 0.0
        while self.save_seconds:
            taken += self.save_seconds.pop()
        return taken


def reward_scores(work, rollouts: list) -> tuple[float | None, ...]:
    """What a reward work's rollouts scored, in the work's sample order (None: masked, e.g. a
    failed judge call): the controller's dynamic sampling decides on them."""
    scores = {r.key: None if getattr(r, "masked", False) else float(r.reward) for r in rollouts}
    return tuple(scores[s] for s in work.samples)


def trainer_runners(worker: ExecutorWorker, stages: dict[str, str]) -> dict:
    """The trainer's passes for each stage it hosts (`stages`: name -> kind), looked up on the
    worker's current trainer (the Ray runtime swaps in a remote one)."""
    return {name: _runner(worker, _role_call(kind)) for name, kind in stages.items()}


def _role_call(kind: str) -> str:
    call = kind_rule(kind).role_call
    assert call is not None, f"a {kind} stage on the trainer, but the kind table names no trainer call for it"
    return call


def _runner(worker: ExecutorWorker, method: str):
    """The kind table's trainer call, looked up when it runs (the trainer may have been swapped)."""
    return lambda rollouts: getattr(worker.learner, method)(rollouts)
