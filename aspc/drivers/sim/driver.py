"""The simulator's driver: runs the controller against the cost model on a virtual clock.

An event is a sample finishing, a batch changing, a learner work ending, a weight transfer
ending or a colocated pool switching between generation and training — never a token.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import assert_never

from aspc.controller import Controller, ControllerConfig
from aspc.controller.events import (Action, Checkpoint, Dispatch, Finished, InstanceIdle, OptimizerStep,
                                    RestartInstance, RunWork, SampleFinished, Start, SyncWeights,
                                    WeightsLoaded, WeightsPublished, WorkFinished)
from aspc.plan.execution_plan import ExecutionPlan, StagePlan
from aspc.costmodel.workload import sample_step
from aspc.costmodel.roofline import (GenerationCost, LearnerCost, dtype_bytes, hardware_of, offload_seconds,
                                    usable_hbm, weight_sync_seconds)
from aspc.algorithms.slots import default_slots
from aspc.costmodel.calibrated import CalibratedGeneration, CalibratedLearner
from aspc.backends.sim.instance import GenInstance
from aspc.costmodel.learner import packed_ranks, work_cost
from aspc.accounting.ledger import Ledger, Span

LEARNER_KINDS = ("reference", "critic", "train")


class SimulationStalled(Exception):
    """The event queue ran dry before the last step: a scheduling deadlock (a bug to report)."""


@dataclass
class LearnerExec:
    """One pool's learner devices: reference, critic and train work run one at a time."""

    pool: str
    devices: int
    shared: bool  # time-shared with generation instances on the same devices
    queue: deque
    busy_until: float | None = None


class Simulation:
    def __init__(self, plan: ExecutionPlan, steps: int, progress=None, calibration=None):
        """`calibration`: measured costs (aspc/costmodel/calibrated.py) instead of the roofline."""
        self.plan, self.steps, self.progress, self.calibration = plan, steps, progress, calibration
        self.config = ControllerConfig.from_plan(plan, steps)
        self.gen_stage = plan.stages_of("generate")[0]
        self.data = plan.dataset(self.gen_stage.data)
        self._steps_cache: dict[int, list] = {}
        self.mean_tokens = self._mean_tokens()  # mean prompt + response length of the workload
        self.controller = Controller(self.config, lambda step, prompt: self._sample(step, prompt, 0).prompt_len)
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.ledger = Ledger()
        self.pending: deque = deque()
        self.finished_at: dict[int, float] = {}
        self.held: list[tuple[float, int]] = [(0.0, 0)]
        self._build_instances()
        self._build_learners()
        self.pool_mode = {p: "gen" for p in self._shared_pools()}
        self.deferred_loads: dict[int, tuple[int, bool]] = {}
        self.switch_spans: list[tuple[float, float, str]] = []
        self.modes: dict[str, list[tuple[float, str]]] = {p: [(0.0, "gen")] for p in self.pool_mode}
        self.learner_busy: dict[str, list[tuple[float, float]]] = {}
        self._packed: dict[tuple, list] = {}
        self.done = False

    # ---- setup ----
    def _sample(self, step: int, prompt: int, index: int):
        if step not in self._steps_cache:
            self._steps_cache[step] = sample_step(self.data, step)
        return self._steps_cache[step][prompt * self.data.group + index]

    def _truth(self, sample) -> int:
        return self._sample(*sample).response_len

    def _build_instances(self):
        stage = self.gen_stage
        model = self.plan.model(stage.model)
        hw = hardware_of(self.plan, stage)
        graph_mode = dict(stage.options).get("graph_mode", True)
        if self.calibration is not None:
            cost = CalibratedGeneration(self.calibration)
            capacity = default_slots(self.data.samples_per_step, len(stage.instances), self.data.group)
        else:
            cost = GenerationCost(model.arch, hw, stage.parallel, dtype_bytes(model.dtype), graph_mode)
            capacity = cost.capacity(self.mean_tokens, usable_hbm(hw))
        static = stage.batching != "continuous"
        self.instances = [GenInstance(i.index, cost, capacity, static, i.device_count) for i in stage.instances]
        self.gen_capacity = capacity
        self.weight_bytes = model.arch.total_params() * dtype_bytes(model.dtype)

    def _mean_tokens(self) -> float:
        samples = sample_step(self.data, 0)
        return sum(s.tokens for s in samples) / len(samples)

    def _build_learners(self):
        self.learners: dict[str, LearnerExec] = {}
        for stage in self.plan.stages:
            if stage.kind not in LEARNER_KINDS:
                continue
            shared = stage.pool == self.gen_stage.pool
            current = self.learners.get(stage.pool)
            devices = stage.instances[0].device_count
            if current is None:
                self.learners[stage.pool] = LearnerExec(stage.pool, devices, shared, deque())
            else:
                current.devices = max(current.devices, devices) if stage.placement == "time_shared" \
                    else current.devices + devices
        self.train_stage = self.plan.stages_of("train")[0]

    def _shared_pools(self) -> list[str]:
        return [p for p, ex in self.learners.items() if ex.shared]

    # ---- the loop ----
    def run(self) -> None:
        self.feed(Start())
        for inst in self.instances:
            self.feed(InstanceIdle(inst.index, inst.capacity))
        self.drain()
        while self.heap and not self.done:
            time, _, kind, payload = heapq.heappop(self.heap)
            self.now = max(self.now, time)
            getattr(self, "_at_" + kind)(*payload)
            self.drain()
        if not self.done:
            raise SimulationStalled(f"the simulation stalled at {self.now:.1f} s after "
                                    f"{self.controller.version} of {self.steps} steps")

    def at(self, time: float, kind: str, *payload) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), kind, payload))

    def feed(self, event) -> None:
        self.pending.extend(self.controller.handle(event))

    def drain(self) -> None:
        while self.pending:
            self.act(self.pending.popleft())
        for pool in self.pool_mode:
            self._maybe_switch(pool)
        self._record_held()

    def _record_held(self) -> None:
        held = self.controller.held_samples()
        if held != self.held[-1][1]:
            self.held.append((self.now, held))

    # ---- actions ----
    def act(self, action: Action) -> None:
        match action:
            case Dispatch():
                self._do_Dispatch(action)
            case RunWork():
                self._do_RunWork(action)
            case OptimizerStep():
                self._do_OptimizerStep(action)
            case SyncWeights():
                self._do_SyncWeights(action)
            case Finished():
                self.done = True
            case Checkpoint():
                pass  # a checkpoint write is not priced yet (the simulator-fidelity issue)
            case RestartInstance():
                pass  # simulated instances never fail
            case _:
                assert_never(action)

    def _do_Dispatch(self, a: Dispatch) -> None:
        inst = self.instances[a.instance]
        inst.admit(self.now, list(a.requests), self._truth)
        if inst.static:
            self.feed(InstanceIdle(a.instance, 0))
        self._schedule_instance(inst)

    def _do_RunWork(self, a: RunWork) -> None:
        stage = self.plan.stage(a.work.stage)
        if stage.kind not in LEARNER_KINDS or stage.pool not in self.learners:
            self.feed(WorkFinished(a.work.id))  # rule rewards and advantages run on the host
            return
        self.learners[stage.pool].queue.append(("work", a.work))
        self._start_learner(self.learners[stage.pool])

    def _do_OptimizerStep(self, a: OptimizerStep) -> None:
        learner = self.learners[self.train_stage.pool]
        learner.queue.append(("optimizer", a.step))
        self._start_learner(learner)

    def _do_SyncWeights(self, a: SyncWeights) -> None:
        inst = self.instances[a.instance]
        if self.pool_mode.get(self.gen_stage.pool, "gen") != "gen":
            self.deferred_loads[a.instance] = (a.version, a.interrupt)
            return
        self._load(inst, a.version, a.interrupt)

    # ---- generation ----
    def _schedule_instance(self, inst: GenInstance) -> None:
        when = inst.next_event()
        if when is not None:
            self.at(when, "instance", inst.index, inst.generation)

    def _at_instance(self, index: int, generation: int) -> None:
        inst = self.instances[index]
        if generation != inst.generation:
            return
        for sample in inst.pop_finished(self.now):
            self.feed(SampleFinished(sample, index, self._truth(sample)))
            self.finished_at[len(self.finished_at)] = self.now
        if inst.static and not inst.active:
            self.feed(InstanceIdle(index, inst.capacity))
        self._schedule_instance(inst)
        if self.progress is not None:
            self.progress(self.controller.version)

    def _load(self, inst: GenInstance, version: int, interrupt: bool) -> None:
        transfer = self.plan.weight_syncs[0].transfer if self.plan.weight_syncs else "link"
        if self.calibration is not None:
            seconds = self.calibration.weight_load
        elif transfer == "offload_onload":
            seconds = offload_seconds(self.weight_bytes / self.gen_stage.parallel.tp, inst.devices)
        else:
            learner = self.learners[self.train_stage.pool]
            seconds = weight_sync_seconds(self.weight_bytes, min(inst.devices, learner.devices))
        end = inst.load_weights(self.now, seconds, interrupt)
        self.at(end, "loaded", inst.index, version)
        self._schedule_instance(inst)

    def _at_loaded(self, index: int, version: int) -> None:
        self.feed(WeightsLoaded(index, version))
        self._schedule_instance(self.instances[index])

    # ---- learner ----
    def _start_learner(self, learner: LearnerExec) -> None:
        if learner.busy_until is not None or not learner.queue:
            return
        if learner.shared and self.pool_mode[learner.pool] != "learn":
            return
        item, payload = learner.queue.popleft()
        seconds = getattr(self, "_run_" + item)(learner, payload)
        learner.busy_until = self.now + seconds
        self.at(learner.busy_until, "learner", learner.pool, item, payload)

    def _run_work(self, learner: LearnerExec, work) -> float:
        stage = self.plan.stage(work.stage)
        cost = self._learner_cost(stage)
        key = (work.step, work.samples[0], len(work.samples), stage.micro_batching, stage.parallel.dp)
        if key not in self._packed:  # reference and train pack the same unit the same way
            lengths = [self._sample(*s).tokens for s in work.samples]
            self._packed[key] = packed_ranks(stage, lengths, self.mean_tokens)
        wc = work_cost(stage, cost, work.kind, self._packed[key])
        self._learner_span(learner, wc, work)
        return wc.seconds

    def _learner_cost(self, stage: StagePlan, recompute: bool | None = None):
        if self.calibration is not None:
            return CalibratedLearner(self.calibration, stage.parallel.tp * stage.parallel.pp * stage.parallel.cp)
        model = self.plan.model(stage.model)
        if recompute is None:
            recompute = bool(dict(stage.options).get("recompute", False))
        return LearnerCost(model.arch, hardware_of(self.plan, stage), stage.parallel, recompute)

    def _learner_span(self, learner: LearnerExec, wc, work) -> None:
        end = self.now + wc.seconds
        label = f"{work.kind} step {work.step} ({len(work.samples)} samples)"
        self.ledger.spans.append(_span(learner.pool, self.now, end, "useful", label))
        for category, amount in (("useful", wc.useful), ("padding", wc.padding), ("skewness", wc.skewness)):
            self.ledger.add(category, amount)
        self.learner_busy.setdefault(learner.pool, []).append((self.now, end))

    def _run_optimizer(self, learner: LearnerExec, step: int) -> float:
        seconds = self._learner_cost(self.train_stage, False).optimizer()
        self.ledger.span(learner.pool, self.now, self.now + seconds, "useful", f"optimizer step {step}",
                         learner.devices)
        self.learner_busy.setdefault(learner.pool, []).append((self.now, self.now + seconds))
        if not learner.shared:
            learner.queue.appendleft(("publish", step + 1))
        return seconds

    def _run_publish(self, learner: LearnerExec, version: int) -> float:
        seconds = self.calibration.weight_load if self.calibration else weight_sync_seconds(self.weight_bytes,
                                                                                            learner.devices)
        self.ledger.span(learner.pool, self.now, self.now + seconds, "sync", f"publish v{version}",
                         learner.devices)
        self.learner_busy.setdefault(learner.pool, []).append((self.now, self.now + seconds))
        return seconds

    def _at_learner(self, pool: str, item: str, payload) -> None:
        learner = self.learners[pool]
        learner.busy_until = None
        if item == "work":
            self.feed(WorkFinished(payload.id))
        elif item == "publish" or (item == "optimizer" and learner.shared):
            self.feed(WeightsPublished(payload if item == "publish" else payload + 1))
        self._start_learner(learner)

    # ---- colocated pools ----
    def _maybe_switch(self, pool: str) -> None:
        learner = self.learners[pool]
        mode = self.pool_mode[pool]
        gen_busy = any(self.controller.has_work(i.index) or i.active for i in self.instances)
        if mode == "gen" and learner.queue and not gen_busy:
            self._switch(pool, "learn")
        elif mode == "learn" and learner.busy_until is None and not learner.queue and (
                gen_busy or self.deferred_loads):
            self._switch(pool, "gen")

    def _switch(self, pool: str, target: str) -> None:
        self.pool_mode[pool] = "switching"
        self.modes[pool].append((self.now, "switching"))
        if target == "learn":
            for inst in self.instances:
                self.feed(InstanceIdle(inst.index, 0))
        # weights + optimizer state move host <-> device; CPU threads share memory: nothing moves
        seconds = 0.0 if self.calibration else offload_seconds(self.weight_bytes * 8, self.learners[pool].devices)
        self.switch_spans.append((self.now, self.now + seconds, pool))
        self.at(self.now + seconds, "switched", pool, target)

    def _at_switched(self, pool: str, target: str) -> None:
        self.pool_mode[pool] = target
        self.modes[pool].append((self.now, target))
        if target == "learn":
            self._start_learner(self.learners[pool])
            return
        for inst in self.instances:
            self.feed(InstanceIdle(inst.index, inst.capacity))
        for index, (version, interrupt) in sorted(self.deferred_loads.items()):
            self._load(self.instances[index], version, interrupt)
        self.deferred_loads.clear()


def _span(track, start, end, category, label):
    return Span(track, start, end, category, label)
