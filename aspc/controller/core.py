"""The controller: events in, actions out; no threads, no clock."""
from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from aspc.controller.config import ControllerConfig
from aspc.controller.devices import DeviceWork, Item
from aspc.controller.dynamic_sampling import GroupFilter
from aspc.controller.events import (Checkpoint, Finished, InstanceFailed, InstanceIdle, InstanceMoved,
                                    InstanceRecovered, OptimizerDone, PoolSwitched, RestartInstance, ResumeEpisode,
                                    RunWork, SampleFinished, SamplesFinished, Start, SwitchPool, SyncWeights,
                                    ToolCalled, ToolReturned, WeightsLoaded, WeightsPublished, WorkFinished)
from aspc.controller.generation import Generation
from aspc.controller.learner import Learner
from aspc.controller.rebalance import Rebalancer
from aspc.controller.tools import ToolRunners

TRAIN_PASSES = 3  # a train pass (forward and backward) weighs three forward passes (rebalance.py)
ENDING = ("timeout", "crashed")  # tool-call statuses that end the episode (aspc/controller/episodes.py)
# Carry-over (Controller._carries_over): a time-shared pool's generation phase ends once the requests
# in flight fill at most this share of the instances' capacity (its tail has begun)
# (0.5 and 1.0 gave step times within 0.2% on dapo_32b at staleness 1 and 2: docs/simulator.md, "Carry-over")
CARRY_BELOW = 0.5
_queue_of = attrgetter("queue")


class Controller:
    """Executes a plan's schedule: dispatch, the staleness gate, streaming, the order of learner
    work, publishing, weight versions, checkpoints and the switching of a time-shared pool.

    `prompt_len(step, prompt)` gives a prompt's length in tokens (known when it is released).
    """

    def __init__(self, config: ControllerConfig, prompt_len: Callable[[int, int], int], start_version: int = 0):
        """`start_version`: resume after that many optimizer steps (steps before it are done)."""
        self.config = config
        self.version = start_version  # published policy version: optimizer steps done
        self.gen = Generation(config, prompt_len, start_version)
        self.learner = Learner(config)
        self.devices = DeviceWork(config)
        self.tools = ToolRunners(config.tool_workers)
        self.host_stages = {s.name for s in config.forward_stages if s.role is None}
        self.shared = [k for k, e in enumerate(config.executors) if e.time_shared]
        self.mode = "gen"  # of the time-shared pool: "gen" | "learn" | "switching" (ignored without one)
        self.contexts: dict = {}  # an episode waiting on a tool -> the tokens of its sequence
        self.staleness: dict[int, int] = {}  # staleness (u - v) -> samples trained (a Counter counts 1.8x slower)
        self.used: set = set()  # samples delivered to training
        self.filter = GroupFilter(config.prompts_per_step, config.group, config.max_prompts, config.stop_at_bound) \
            if config.filters_groups else None  # dynamic sampling (dynamic_sampling.py)
        self.finished = start_version >= config.steps  # resumed at the end: nothing to do
        self.rebalancer = Rebalancer(config.rebalance) if config.rebalance is not None else None
        self.moving: set[int] = set()  # instances whose move the trainer's executor carries out

    def handle(self, event) -> list:
        if isinstance(event, SampleFinished):
            event = SamplesFinished(event.instance, (event,))
        if self.rebalancer is not None:
            self._observe(self.rebalancer, event)
        handler = getattr(self, "_on_" + type(event).__name__)
        actions = handler(event)
        # finished samples free capacity on their own instance only; anything else may change more
        only = event.instance if isinstance(event, SamplesFinished) else None
        return actions + self._pump(only)

    # -- events --
    def _on_Start(self, event: Start) -> list:
        return []

    def _on_InstanceIdle(self, event: InstanceIdle) -> list:
        self.gen.instances[event.instance].capacity = event.capacity
        return []

    def _on_SamplesFinished(self, event: SamplesFinished) -> list:
        if self.rebalancer is None and self.filter is None and self.gen.instances[event.instance].pending_sync is None:
            return self._finished_together(event)
        actions = []
        for finished in event.finished:
            if self.rebalancer is not None:
                self._observe_finish(self.rebalancer, finished)
            actions += self._on_SampleFinished(finished)
        return actions

    def _finished_together(self, event: SamplesFinished) -> list:
        """The common case of a decode step's finishes (no weight sync waits on the instance, no
        rebalancer, no group filter) at once: the same actions in the same order as one at a time,
        since the learner's units depend on the samples' order only."""
        samples = self.gen.finish(event.instance, event.finished)
        self._delivered(samples)
        works = self.learner.samples_done(samples)
        return self._route(works) if works else []

    def _on_SampleFinished(self, event: SampleFinished) -> list:
        if not self.gen.finish(event.instance, (event,)):
            return []
        sample = event.sample
        if self.filter is None:
            self._delivered([sample])
        elif self.filter.full(sample[0]):  # surplus of dynamic sampling: never scored nor trained
            return self._syncs_after_finish(event.instance)
        works = self.learner.sample_done(sample)  # none but for a group's last sample
        return (self._route(works) if works else []) + self._syncs_after_finish(event.instance)

    def _syncs_after_finish(self, i: int) -> list:
        """The pending weight sync a finished sample lets start: its instance drained, or (episodes
        under partial rollout) every episode left is between two turns."""
        if self.gen.instances[i].pending_sync is None:  # nothing to sync (the common case)
            return []
        return self._drained_syncs(i) + self._turn_boundary_sync(i)

    def _on_ToolCalled(self, event: ToolCalled) -> list:
        if self.gen.inflight.get(event.sample) != event.instance or event.sample in self.contexts:
            return []  # its instance failed meanwhile (a late report of the lost run)
        self.gen.tool_called(event.sample, event.instance, event.turns, event.generated)
        self.tools.submit(event.sample, event.instance)
        self.contexts[event.sample] = event.context
        return self._turn_boundary_sync(event.instance)

    def _on_ToolReturned(self, event: ToolReturned) -> list:
        call = self.tools.done(event.runner)
        if call is None or self.gen.inflight.get(call[0]) != call[1]:
            return []  # the episode was lost with its instance and is redone
        sample, home = call
        inst = self.gen.instances[home]
        inst.on_tool.discard(sample)
        context = self.contexts.pop(sample)
        if event.status in ENDING:
            return [ResumeEpisode(sample, home, home)]  # it ends where it is
        if self._cuts_at_turns(home):  # its weight sync comes first: the next turn runs on the new weights
            inst.deferred.append((sample, context))
            return self._turn_boundary_sync(home)
        return [self._resume(sample, home, context)]

    def _resume(self, sample, home: int, context: int) -> ResumeEpisode:
        target = self.gen.resume_target(sample, home, context)
        if target != home:
            self.gen.move(sample, home, target, context)
        return ResumeEpisode(sample, target, home)

    def _on_WorkFinished(self, event: WorkFinished) -> list:
        work = self.learner.work.get(event.work)
        if self.filter is not None and work is not None and work.kind == "reward":
            assert event.rewards is not None, f"the driver reported no rewards for {work}"
            self.filter.add_rewards(work.samples, event.rewards)
        self.devices.work_done(event.work)
        step = self.learner.work_done(event.work)
        if step is not None:
            self.devices.submit(Item("optimizer", step=step))
        return self._filter_scored() if self.filter is not None else []

    def _on_OptimizerDone(self, event: OptimizerDone) -> list:
        self.devices.trainer_done("optimizer")
        self.devices.submit(Item("publish", step=event.step + 1), first=True)
        return []

    def _on_WeightsPublished(self, event: WeightsPublished) -> list:
        self.devices.trainer_done("publish")
        self.version = event.version
        actions = []
        every = self.config.checkpoint_every
        if every and (event.version % every == 0 or event.version >= self.config.steps):
            actions.append(Checkpoint(event.version))
        if event.version >= self.config.steps:
            self.finished = True
            return actions + [Finished(event.version)]
        self._rebalance(event.version)
        for i, inst in enumerate(self.gen.instances):
            if inst.live and not inst.away:
                inst.pending_sync = event.version
                actions += self._sync_if_ready(i)
        return actions

    def _on_WeightsLoaded(self, event: WeightsLoaded) -> list:
        inst = self.gen.instances[event.instance]
        inst.loaded = max(inst.loaded, event.version)
        inst.syncing = None
        if inst.pending_sync is not None and inst.pending_sync <= event.version:
            inst.pending_sync = None
        deferred, inst.deferred = inst.deferred, []
        return [self._resume(sample, event.instance, context) for sample, context in deferred]

    def _on_PoolSwitched(self, event: PoolSwitched) -> list:
        self.mode = event.mode
        self.gen.paused = event.mode != "gen"
        if event.mode != "gen":
            return []
        return [a for i in range(len(self.gen.instances)) for a in self._sync_if_ready(i)]

    def _on_InstanceMoved(self, event: InstanceMoved) -> list:
        self.devices.trainer_done("move")
        self.moving.discard(event.instance)
        assert self.rebalancer is not None, "an instance moved without a rebalancer"
        self.rebalancer.moved(event.instance, event.role)
        if event.role == "learn":
            return []
        inst = self.gen.instances[event.instance]
        inst.away = False
        inst.pending_sync = self.version  # it generates again once it holds the current weights
        return self._sync_if_ready(event.instance)

    def _on_InstanceFailed(self, event: InstanceFailed) -> list:
        self.tools.forget(event.instance)
        self.gen.fail(event.instance)
        return [RestartInstance(event.instance)]

    def _on_InstanceRecovered(self, event: InstanceRecovered) -> list:
        inst = self.gen.instances[event.instance]
        inst.live = True
        inst.pending_sync = inst.syncing = self.version
        return [SyncWeights(event.instance, self.version, False)]

    # -- dynamic sampling --
    def _delivered(self, samples: list) -> None:
        staleness, start_version, used = self.staleness, self.gen.start_version, self.used
        for sample in samples:
            stale = sample[0] - start_version[sample]
            staleness[stale] = staleness.get(stale, 0) + 1
        used.update(samples)

    def _filter_scored(self) -> list:
        """Each group whose scores are in: the groups now sure to be in the step's batch join its
        units; then the step is topped up with more prompts, or cancels what it still queues once
        it is full."""
        actions: list = []
        scored, self.learner.scored = self.learner.scored, []
        group_filter = self.filter
        assert group_filter is not None, "groups scored for a filter without dynamic sampling"
        for step, prompt in scored:
            group_filter.decide(step, prompt)
            actions += self._admit(step, group_filter.admissible(step))
            if not group_filter.full(step):
                self.gen.release_prompts(step, group_filter.top_up(step))
                actions += self._admit(step, group_filter.padding(step))
            if group_filter.full(step) and not group_filter.steps[step].closed:
                group_filter.close(step, self.gen.cancel(step))
        return actions

    def _admit(self, step: int, prompts: list[int]) -> list:
        self._delivered([(step, p, g) for p in prompts for g in range(self.config.group)])
        return self._route([w for p in prompts for w in self.learner.admit(step, p)])

    # -- learner-side work --
    def _route(self, works: list) -> list:
        """Host stages run at once (the driver itself, no devices); the rest queue for executors."""
        actions = []
        for work in works:
            if work.stage in self.host_stages:
                actions.append(RunWork(work, None))
            else:
                self.devices.submit(Item("work", work))
        return actions

    def _may_learn(self, k: int) -> bool:
        return k not in self.shared or self.mode == "learn"

    def _switches(self) -> list:
        """Hand a time-shared pool to the learner when generation has nothing it can run and the
        learner has, or when the generation phase may end before its tail (`_carries_over`); and
        back when the learner is done and generation has work."""
        if not self.shared or self.mode == "switching":
            return []
        # the cheap tests first: `gen_busy` scans every instance and queue (after every event)
        if self.mode == "gen" and self.devices.waiting_for(self.shared) \
                and (not self._gen_busy() or self._carries_over()):
            target = "learn"
        elif self.mode == "learn" and not self.devices.busy(self.shared) \
                and not self.devices.waiting_for(self.shared) and self._gen_busy():
            target = "gen"
        else:
            return []
        pool = self.config.shared_pool
        assert pool is not None, "time-shared executors without a shared pool"
        self.mode = "switching"
        self.gen.paused = True
        return [SwitchPool(pool, target)]

    def _carries_over(self) -> bool:
        """Partial rollout on a time-shared pool ends a generation phase at its tail instead of
        draining it (docs/simulator.md, "Carry-over"): once the next step to train has all its
        samples, nothing is queued, and what is still in flight is at most CARRY_BELOW of the
        instances' capacity, the learner takes the pool. The requests in flight pause there (their
        KV is dropped with the engine's memory) and go on after the learner's new weights, an
        interrupting weight sync, so each is split once more (at most `partial_rollout` times).
        They belong to later steps, released under the staleness bound, so they stay within it."""
        if not self.config.partial_rollout or self.config.tool_workers or self.filter is not None:
            return False
        gen = self.gen
        if not gen.complete_through(self.version) or any(map(_queue_of, gen.instances)):
            return False
        running = capacity = 0
        for i, inst in enumerate(gen.instances):
            if not inst.live or inst.away:
                continue
            if inst.pending_sync is not None or inst.syncing is not None or not self._splittable(i):
                return False
            running += len(inst.inflight)
            capacity += inst.capacity
        return running <= CARRY_BELOW * capacity

    def _gen_busy(self) -> bool:
        for i in range(len(self.gen.instances)):  # a loop, not a generator: asked after every event
            if self.has_work(i):
                return True
        return False

    # -- runtime rebalancing (rebalance.py) --
    def _rebalance(self, version: int) -> None:
        """At a step boundary: decide a move, and start the moves of drained lent instances on the
        trainer's executor (which is free: it has just published)."""
        if self.rebalancer is None:
            return
        decision = self.rebalancer.step_boundary(version, self.config.steps)
        if decision is not None and decision[0] == "learn":
            self.gen.leave(decision[1])
        elif decision is not None:
            self._move(decision[1], "gen")
        for i in sorted(self.rebalancer.leaving - self.moving):
            if self.gen.drained(i):
                self._move(i, "learn")

    def _observe(self, rebalancer: Rebalancer, event) -> None:
        """What the rebalancer measures, in the state before the event."""
        if isinstance(event, WorkFinished) and self.devices.where.get(event.work) == self.devices.trainer:
            work = self.learner.work[event.work]
            passes = len(work.samples) * (TRAIN_PASSES if work.kind == "train" else 1)
            rebalancer.trainer_progress(passes, self._gate_idle())
        elif isinstance(event, InstanceMoved):
            rebalancer.new_layout()

    def _observe_finish(self, rebalancer: Rebalancer, event: SampleFinished) -> None:
        """A finished sample as the rebalancer measures it, in the state before it is handled."""
        if self.gen.inflight.get(event.sample) == event.instance:
            rebalancer.sample_finished(event.instance, event.sample, event.response_len, self._learner_idle())

    def _move(self, instance: int, role: str) -> None:
        self.moving.add(instance)
        self.devices.submit(Item("move", instance=instance, role=role), first=True)

    def _learner_idle(self) -> bool:
        """The trainer's executor is free and nothing queued may run on it: it waits for samples."""
        k = self.devices.trainer
        return not self.finished and self.devices.running[k] is None and not self.devices.waiting_for([k])

    def _gate_idle(self) -> float:
        """The share of generating instances with nothing to run while the staleness gate holds
        the next step back."""
        gen = self.gen
        if self.finished or gen.paused or gen.released_steps >= self.config.steps:
            return 0.0
        generating = [inst for inst in gen.instances if inst.live and not inst.away]
        idle = [inst for inst in generating if not inst.inflight and inst.pending_sync is None
                and not any(gen.dispatchable(u, inst) for u in inst.queue)]
        return len(idle) / len(generating) if generating else 0.0

    # -- weight syncs --
    def _sync_if_ready(self, i: int) -> list:
        """Sync now if the instance is drained, or interrupt it under partial rollout; an instance
        whose pool the learner holds syncs when the pool comes back."""
        inst = self.gen.instances[i]
        if inst.pending_sync is None or inst.pending_sync <= inst.loaded:
            inst.pending_sync = None
            return []
        if self.gen.paused:
            return []
        if not inst.inflight:
            return self._sync(i, inst.pending_sync, False)
        if self._splittable(i) and not (self.config.tool_workers and inst.decoding()):
            for s in inst.inflight:
                self.gen.splits[s] = self.gen.splits.get(s, 0) + 1
            return self._sync(i, inst.pending_sync, True)
        return []  # drain first (or, for episodes, let the turns under way end)

    def _splittable(self, i: int) -> bool:
        """Partial rollout may split every in-flight request of instance i once more."""
        limit = self.config.partial_rollout
        return bool(limit) and all(self.gen.splits.get(s, 0) < limit for s in self.gen.instances[i].inflight)

    def _cuts_at_turns(self, i: int) -> bool:
        """Episodes under partial rollout: a pending weight sync waits for the turns under way to
        end and holds back episodes whose tool answered, then loads with every episode between two
        turns (each next turn runs on the new weights)."""
        inst = self.gen.instances[i]
        return (bool(self.config.tool_workers) and inst.pending_sync is not None and inst.syncing is None
                and inst.live and not self.gen.paused and self._splittable(i))

    def _turn_boundary_sync(self, i: int) -> list:
        inst = self.gen.instances[i]
        if self._cuts_at_turns(i) and not inst.decoding():
            return self._sync_if_ready(i)
        return []

    def _sync(self, i: int, version: int, interrupt: bool) -> list:
        """Sync instance i to `version` (its pending sync), unless that sync is under way."""
        inst = self.gen.instances[i]
        if inst.syncing == version:
            return []
        inst.syncing = version
        return [SyncWeights(i, version, interrupt)]

    def _drained_syncs(self, i: int) -> list:
        inst = self.gen.instances[i]
        if inst.pending_sync is not None and inst.live and not inst.inflight:
            return self._sync_if_ready(i)
        return []

    # -- after every event --
    def _pump(self, only: int | None = None) -> list:
        if self.finished:
            return []
        self.gen.release(self.version, self.filter.opening if self.filter is not None else None)
        actions: list = self.gen.dispatch_all(only)
        if self.rebalancer is not None:
            for d in actions:
                self.rebalancer.dispatched(d.instance, [r.sample for r in d.requests])
        for work in self.learner.runnable_train(self.version):
            self.devices.submit(Item("work", work))
        actions += self.devices.start(self._may_learn)
        return actions + self.tools.start() + self._switches()

    # -- what drivers, tests and reports read --
    def has_work(self, i: int) -> bool:
        """Whether instance i runs, holds or could take work, or must load weights."""
        inst = self.gen.instances[i]
        if inst.away:
            return False
        if inst.inflight or inst.pending_sync is not None:
            return True
        queues = [inst.queue] + ([o.queue for o in self.gen.instances] if self.config.policy == "queue_aware" else [])
        return any(self.gen.dispatchable(u, inst) for q in queues for u in q)

    def trained_prompts(self, step: int) -> list[int]:
        """The prompts whose groups a step trains (dynamic sampling keeps some of more)."""
        if self.filter is None or step not in self.filter.steps:
            return list(range(self.config.prompts_per_step))
        return sorted(self.filter.steps[step].admitted)

    def held_samples(self) -> int:
        """Finished samples not yet handed to the learner (incomplete groups, units or steps)."""
        return len(self.used) - self.learner.grouped_total

    def idle_while_others_queue(self) -> list[tuple[int, int]]:
        """(idle instance, instance with queued work it could take): empty under queue-aware dispatch.
        Idle: nothing queued or in flight (a busy instance steals only what evens the loads out)."""
        pairs: list[tuple[int, int]] = []
        if self.gen.paused:
            return pairs
        for i, inst in enumerate(self.gen.instances):
            if not inst.live or inst.away or inst.pending_sync is not None or inst.queue or inst.inflight:
                continue
            for j, other in enumerate(self.gen.instances):
                if j != i and any(self.gen.dispatchable(u, inst) for u in other.queue):
                    pairs.append((i, j))
        return pairs
