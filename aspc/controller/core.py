"""The controller: events in, actions out; no threads, no clock."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from aspc.controller.config import ControllerConfig
from aspc.controller.events import (Checkpoint, Finished, InstanceFailed, InstanceIdle,
                                    InstanceRecovered, OptimizerStep, RestartInstance, RunWork,
                                    SampleFinished, Start, SyncWeights, WeightsLoaded, WeightsPublished,
                                    WorkFinished)
from aspc.controller.generation import Generation
from aspc.controller.learner import Learner


class Controller:
    """Executes a plan's schedule: dispatch, the staleness gate, streaming, weight versions.

    `prompt_len(step, prompt)` gives a prompt's length in tokens (known when it is released).
    """

    def __init__(self, config: ControllerConfig, prompt_len: Callable[[int, int], int], start_version: int = 0):
        """`start_version`: resume after that many optimizer steps (steps before it are done)."""
        self.config = config
        self.version = start_version  # published policy version: optimizer steps done
        self.gen = Generation(config, prompt_len, start_version)
        self.learner = Learner(config)
        self.staleness = Counter()  # staleness (u - v) of every sample trained
        self.used: set = set()  # samples delivered to training
        self.finished = start_version >= config.steps  # resumed at the end: nothing to do

    def handle(self, event) -> list:
        handler = getattr(self, "_on_" + type(event).__name__)
        actions = handler(event)
        # a finished sample frees capacity on its own instance only; anything else may change more
        only = event.instance if isinstance(event, SampleFinished) else None
        return actions + self._pump(only)

    # -- events --
    def _on_Start(self, event: Start) -> list:
        return []

    def _on_InstanceIdle(self, event: InstanceIdle) -> list:
        self.gen.instances[event.instance].capacity = event.capacity
        return []

    def _on_SampleFinished(self, event: SampleFinished) -> list:
        if not self.gen.finish(event.sample, event.instance, event.response_len):
            return []
        sample = event.sample
        self.staleness[sample[0] - self.gen.start_version[sample]] += 1
        self.used.add(sample)
        actions = [RunWork(w) for w in self.learner.sample_done(sample)]
        return actions + self._drained_syncs(event.instance)

    def _on_WorkFinished(self, event: WorkFinished) -> list:
        step = self.learner.work_done(event.work)
        return [] if step is None else [OptimizerStep(step)]

    def _on_WeightsPublished(self, event: WeightsPublished) -> list:
        self.version = event.version
        actions = []
        every = self.config.checkpoint_every
        if every and (event.version % every == 0 or event.version >= self.config.steps):
            actions.append(Checkpoint(event.version))
        if event.version >= self.config.steps:
            self.finished = True
            return actions + [Finished(event.version)]
        for i, inst in enumerate(self.gen.instances):
            if inst.live:
                inst.pending_sync = event.version
                actions += self._sync_if_ready(i)
        return actions

    def _on_WeightsLoaded(self, event: WeightsLoaded) -> list:
        inst = self.gen.instances[event.instance]
        inst.loaded = max(inst.loaded, event.version)
        inst.syncing = None
        if inst.pending_sync is not None and inst.pending_sync <= event.version:
            inst.pending_sync = None
        return []

    def _on_InstanceFailed(self, event: InstanceFailed) -> list:
        self.gen.fail(event.instance)
        return [RestartInstance(event.instance)]

    def _on_InstanceRecovered(self, event: InstanceRecovered) -> list:
        inst = self.gen.instances[event.instance]
        inst.live = True
        inst.pending_sync = inst.syncing = self.version
        return [SyncWeights(event.instance, self.version, False)]

    # -- weight syncs --
    def _sync_if_ready(self, i: int) -> list:
        """Sync now if the instance is drained, or interrupt it under partial rollout."""
        inst = self.gen.instances[i]
        if inst.pending_sync is None or inst.pending_sync <= inst.loaded:
            inst.pending_sync = None
            return []
        if not inst.inflight:
            return self._sync(i, False)
        limit = self.config.partial_rollout
        if limit and all(self.gen.splits.get(s, 0) < limit for s in inst.inflight):
            for s in inst.inflight:
                self.gen.splits[s] = self.gen.splits.get(s, 0) + 1
            return self._sync(i, True)
        return []  # drain first: no new work until its in-flight requests finish

    def _sync(self, i: int, interrupt: bool) -> list:
        inst = self.gen.instances[i]
        if inst.syncing == inst.pending_sync:
            return []
        inst.syncing = inst.pending_sync
        return [SyncWeights(i, inst.pending_sync, interrupt)]

    def _drained_syncs(self, i: int) -> list:
        inst = self.gen.instances[i]
        if inst.pending_sync is not None and inst.live and not inst.inflight:
            return self._sync(i, False)
        return []

    # -- after every event --
    def _pump(self, only: int | None = None) -> list:
        if self.finished:
            return []
        self.gen.release(self.version)
        actions: list = self.gen.dispatch_all(only)
        actions += [RunWork(w) for w in self.learner.runnable_train(self.version)]
        return actions

    # -- what drivers, tests and reports read --
    def has_work(self, i: int) -> bool:
        """Whether instance i runs, holds or could take work, or must load weights."""
        inst = self.gen.instances[i]
        if inst.inflight or inst.pending_sync is not None:
            return True
        queues = [inst.queue] + ([o.queue for o in self.gen.instances] if self.config.policy == "queue_aware" else [])
        return any(self.gen.dispatchable(u, inst) for q in queues for u in q)

    def held_samples(self) -> int:
        """Finished samples not yet handed to the learner (incomplete groups, units or steps)."""
        return len(self.used) - sum(self.learner.grouped.values())

    def idle_while_others_queue(self) -> list[tuple[int, int]]:
        """(idle instance, instance with queued work it could take): empty under queue-aware dispatch."""
        pairs = []
        for i, inst in enumerate(self.gen.instances):
            if not inst.live or inst.pending_sync is not None or inst.queue or len(inst.inflight) >= inst.capacity:
                continue
            for j, other in enumerate(self.gen.instances):
                if j != i and any(self.gen.dispatchable(u, inst) for u in other.queue):
                    pairs.append((i, j))
        return pairs
