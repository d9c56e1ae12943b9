"""The simulator's driver: runs the controller on a virtual clock, with every action priced by
the simulator backend's executors (backends/sim/pricing.py: the roofline or a calibration).

An event is a sample finishing, a batch changing, a tool call ending, a learner-side item ending,
a weight transfer ending or a time-shared pool changing hands — never a token. The driver
decides nothing: the controller chooses what runs where and when; this file only prices and
times it (and runs the episodes' tool calls on the environment's runners, aspc/drivers/sim/episodes.py).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from operator import itemgetter
from typing import assert_never

from aspc.accounting.ledger import Ledger, Span
from aspc.controller import Controller, ControllerConfig
from aspc.controller.config import ExecutorSpec
from aspc.controller.events import (Action, Checkpoint, Dispatch, Finished, InstanceIdle, InstanceMoved, MoveInstance,
                                    OptimizerDone, OptimizerStep, PoolSwitched, PublishWeights, RestartInstance,
                                    ResumeEpisode, RunTool, RunWork, SampleFinished, SamplesFinished, Start, SwitchPool,
                                    SyncWeights, ToolCalled, ToolReturned, WeightsLoaded, WeightsPublished, Work,
                                    WorkFinished)
from aspc.controller.episodes import EpisodePolicy
from aspc.costmodel.workload import Environment, draw_episode, draw_rewards, step_lengths
from aspc.drivers.sim.episodes import EpisodePlan, plan_episode
from aspc.plan.execution_plan import ExecutionPlan, StagePlan
from aspc.roles import Pricing  # what the simulator asks of its executors


class SimulationStalled(Exception):
    """The event queue ran dry before the last step: a scheduling deadlock (a bug to report)."""


@dataclass
class ExecutorState:
    """One learner-side executor's devices: what it ran, for the ledger."""

    spec: ExecutorSpec
    devices: int
    busy: list[tuple[float, float]] = field(default_factory=list)
    running: bool = False
    lent: int = 0  # devices of generation instances lent to it (runtime rebalancing)


class StepLengths:
    """(prompt lengths, response lengths) of each step's samples, drawn once. The controller reads
    prompt lengths from it, not from the simulation: a callback bound to the simulation made a
    reference cycle, and the simulation's hundreds of thousands of records waited for the cyclic
    collector instead of being freed when it ended."""

    def __init__(self, data, prompts_drawn: int):
        self.data, self.prompts_drawn = data, prompts_drawn
        self.drawn: dict[int, tuple[list[int], list[int]]] = {}

    def step(self, step: int) -> tuple[list[int], list[int]]:
        lengths = self.drawn.get(step)
        if lengths is None:
            lengths = self.drawn[step] = step_lengths(self.data, step, prompts_drawn=self.prompts_drawn)
        return lengths

    def prompt_len(self, step: int, prompt: int) -> int:
        return self.step(step)[0][prompt]


class Simulation:
    def __init__(self, plan: ExecutionPlan, steps: int, pricing: Pricing, progress=None):
        self.plan, self.steps, self.pricing, self.progress = plan, steps, pricing, progress
        self.cores = getattr(pricing, "cores", None)  # shared CPU cores, calibrated runs (aspc/costmodel/cores.py)
        self.config = ControllerConfig.from_plan(plan, steps)
        self.gen_stage = plan.stages_of("generate")[0]
        assert self.gen_stage.pool is not None, "the generate stage runs on no pool"
        self.gen_pool: str = self.gen_stage.pool
        self.train_stage = plan.stages_of("train")[0]
        self.data = plan.dataset_of(self.gen_stage)
        self.workload = StepLengths(self.data, self.config.prompt_stride)
        self._lengths = self.workload.drawn  # step -> (prompt lengths, response lengths)
        self._rewards: dict[tuple[int, int], list[float]] = {}
        self.controller = Controller(self.config, self.workload.prompt_len)
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.ledger = Ledger()
        self.pending: deque = deque()
        self.draining = False
        self.held: list[tuple[float, int]] = [(0.0, 0)]
        self.instances = [pricing.generation_instance(self.gen_stage, i) for i in self.gen_stage.instances]
        self.gen_capacity = self.instances[0].capacity
        self.executors = [ExecutorState(spec, len(spec.devices)) for spec in self.config.executors]
        shared = self.config.shared_pool
        self.modes: dict[str, list[tuple[float, str]]] = {shared: [(0.0, "gen")]} if shared else {}
        self.switch_spans: list[tuple[float, float, str]] = []
        self.lent_spans: dict[int, list[list[float]]] = {}  # instance -> [start, end] while the trainer holds it
        self.moves: list[tuple[float, int, str]] = []  # (when it started, instance, role)
        self.loads: list[tuple[float, float]] = []  # instances' weight transfers not yet over (start, end)
        self.done = False
        envs = plan.stages_of("environment")
        self.env = Environment.of(dict(envs[0].options)) if envs else None
        self.policy = EpisodePolicy.of(envs[0]) if envs else None
        self._episodes: dict[tuple, EpisodePlan] = {}
        self._calls_done: dict[tuple, int] = {}
        self.tool_calls = 0
        self.endings: dict[str, int] = {}

    # ---- the workload ----
    def _step(self, step: int) -> tuple[list[int], list[int]]:
        return self.workload.step(step)

    def prompt_len(self, step: int, prompt: int) -> int:
        return self.workload.prompt_len(step, prompt)

    def response_len(self, sample) -> int:
        """The response length drawn for the sample (an episode's first turn is drawn from it)."""
        step, prompt, index = sample
        lengths = self._lengths.get(step) or self._step(step)  # inline: asked for every sample admitted
        return lengths[1][prompt * self.data.group + index]

    def rewards(self, work: Work) -> tuple[float, ...] | None:
        """A reward work's scores when the plan filters groups (dynamic sampling), drawn from the
        train stage's solve_rates (aspc/costmodel/workload.py); None otherwise."""
        if not self.config.filters_groups or work.kind != "reward":
            return None
        rates = dict(self.train_stage.options)["solve_rates"]
        for group in {s[:2] for s in work.samples} - self._rewards.keys():
            self._rewards[group] = draw_rewards(self.data, rates, *group)
        return tuple(self._rewards[s[:2]][s[2]] for s in work.samples)

    def _truth(self, sample) -> int:
        """The model tokens the sample generates (over all its turns)."""
        if self.env:
            return self.episode(sample).model_tokens
        return self.response_len(sample)

    def tokens(self, sample) -> int:
        """The sample's whole sequence as the learner reads it: prompt, turns and tool results."""
        prompt_len = self.prompt_len(*sample[:2])
        if self.env is None:
            return prompt_len + self.response_len(sample)
        episode = self.episode(sample)
        return prompt_len + episode.model_tokens + episode.observation_tokens

    def group_model_tokens(self, step: int, prompt: int) -> int:
        """`_truth` summed over the prompt's group."""
        group = self.data.group
        if self.env is not None:
            return sum(self._truth((step, prompt, g)) for g in range(group))
        return sum(self._step(step)[1][prompt * group:(prompt + 1) * group])

    def _tokens_of(self, samples) -> list[int]:
        """`tokens` of each sample (a learner work reads thousands)."""
        if self.env is not None:
            return [self.tokens(s) for s in samples]
        group, out = self.data.group, []
        for step, run in itertools.groupby(samples, key=itemgetter(0)):  # a unit's samples share a step
            prompts, responses = self._step(step)
            out += [prompts[prompt] + responses[prompt * group + index] for _, prompt, index in run]
        return out

    def episode(self, sample) -> EpisodePlan:
        if sample not in self._episodes:
            step, prompt, index = sample
            assert self.env is not None and self.policy is not None, "an episode in a plan without an environment"
            draw = draw_episode(self.env, self.data, step, prompt, index, self.response_len(sample))
            self._episodes[sample] = plan_episode(self.env, self.policy, draw)
        return self._episodes[sample]

    def _turns(self, sample) -> tuple[tuple[int, ...], tuple[int, ...]]:
        episode = self.episode(sample)
        return episode.turns, tuple(c.observation for c in episode.calls)

    # ---- the loop ----
    def run(self) -> None:
        self.feed(Start())
        for inst in self.instances:
            self.feed(InstanceIdle(inst.index, inst.capacity))
        while self.heap and not self.done:
            time, _, kind, payload = heapq.heappop(self.heap)
            self.now = max(self.now, time)
            getattr(self, "_at_" + kind)(*payload)
            if self.pending or self.cores is not None:  # what fed the controller drained already
                self.drain()
        if not self.done:
            raise SimulationStalled(f"the simulation stalled at {self.now:.1f} s after "
                                    f"{self.controller.version} of {self.steps} steps")

    def at(self, time: float, kind: str, *payload) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), kind, payload))

    def feed(self, event) -> None:
        """The controller handles the event and its actions are carried out before the next event
        (events the actions cause at this instant queue behind them), as the local driver does."""
        self.pending.extend(self.controller.handle(event))
        if not self.draining:
            self.drain()

    def drain(self) -> None:
        if self.pending:  # most events (a decode step's finishes) cause no action
            self.draining = True
            while self.pending:
                self.act(self.pending.popleft())
            self.draining = False
        if self.cores is not None:
            self.cores.settle(self)
        held = self.controller.held_samples()
        if held != self.held[-1][1]:
            self.held.append((self.now, held))

    # ---- actions ----
    def act(self, action: Action) -> None:
        match action:
            case Dispatch():
                self._dispatch(action)
            case RunWork():
                self._run_work(action)
            case OptimizerStep():
                label = f"optimizer step {action.step}"
                seconds = self.pricing.optimizer(self._loading())
                self._occupy(self._trainer(), seconds, "useful", label, OptimizerDone(action.step))
            case PublishWeights():
                ex = self._trainer()
                seconds = self.pricing.publish(ex.devices, ex.spec.time_shared)
                self._occupy(ex, seconds, "sync", f"publish v{action.version}", WeightsPublished(action.version))
            case SyncWeights():
                self._load(action)
            case RunTool():
                self._run_tool(action)
            case ResumeEpisode():
                self._resume_episode(action)
            case SwitchPool():
                self._switch(action)
            case MoveInstance():
                self._move(action)
            case Finished():
                self.done = True
            case Checkpoint():
                pass  # a checkpoint write is not priced yet (the simulator-fidelity issue, 15)
            case RestartInstance():
                pass  # simulated instances never fail
            case _:
                assert_never(action)

    def _dispatch(self, a: Dispatch) -> None:
        inst = self.instances[a.instance]
        inst.admit(self.now, list(a.requests), self.response_len, self._turns if self.env else None)
        if inst.static:
            self.feed(InstanceIdle(a.instance, 0))
        self._schedule_instance(inst)

    def _run_work(self, a: RunWork) -> None:
        if a.executor is None:  # rule and python rewards and advantages run on the host
            self.feed(WorkFinished(a.work.id, self.rewards(a.work)))
            return
        ex = self.executors[a.executor]
        stage = _widened(self.plan.stage(a.work.stage), ex.lent)
        lengths = self._tokens_of(a.work.samples)
        wc = self.pricing.work(a.work, stage, lengths)
        label = f"{a.work.kind} step {a.work.step} ({len(a.work.samples)} samples)"
        self._occupy(ex, wc.seconds, None, label, WorkFinished(a.work.id, self.rewards(a.work)))
        for category, amount in (("useful", wc.useful), ("padding", wc.padding), ("skewness", wc.skewness),
                                 ("tail", wc.tail), ("sorting", wc.dispatch)):
            self.ledger.add(category, amount)

    def _trainer(self) -> ExecutorState:
        return self.executors[self.controller.devices.trainer]

    def _occupy(self, ex: ExecutorState, seconds: float, category: str | None, label: str, then) -> None:
        """The executor works for `seconds`, then `then` is fed to the controller. `category`
        None: the caller books the device-seconds (a work's useful, padding and skewness)."""
        assert not ex.running, f"{ex.spec.name} was given {label} while busy"
        end = self.now + seconds
        ex.running = True
        ex.busy.append((self.now, end))
        if category is None:
            self.ledger.spans.append(Span(ex.spec.name, self.now, end, "useful", label))
        else:
            self.ledger.span(ex.spec.name, self.now, end, category, label, ex.devices + ex.lent)
        self.at(end, "executor", ex, then)

    def _at_executor(self, ex: ExecutorState, then) -> None:
        ex.running = False
        self.feed(then)
        if self.progress is not None:  # the policy version moves only when the trainer's publish ends
            self.progress(self.controller.version)

    # ---- generation ----
    def _schedule_instance(self, inst) -> None:
        when = inst.next_event()
        if when is not None:
            self.at(when, "instance", inst.index, inst.generation)

    def _at_instance(self, index: int, generation: int) -> None:
        inst = self.instances[index]
        if generation != inst.generation:
            return
        finished = inst.pop_finished(self.now)
        if finished:
            self._finish(index, finished)
        if inst.calls:
            for sample in inst.pop_calls():
                self._call_tool(index, sample)
        if inst.static and not inst.live:
            self.feed(InstanceIdle(index, inst.capacity))
        self._schedule_instance(inst)

    def _finish(self, index: int, samples) -> None:
        """The samples the instance finished at this instant, reported together (as the local
        driver's generation worker reports one decode step's)."""
        if self.env is None:  # response_len and SampleFinished's fields inlined (without its Python __new__);
            drawn, group, new = self._lengths, self.data.group, tuple.__new__  # its step was drawn at its admission
            finished = tuple([new(SampleFinished, (s, index, drawn[s[0]][1][s[1] * group + s[2]], 1)) for s in samples])
            self.feed(new(SamplesFinished, (index, finished)))
            return
        self.feed(SamplesFinished(index, tuple(SampleFinished(s, index, self._truth(s), len(self.episode(s).turns))
                                               for s in samples)))
        for sample in samples:
            self._calls_done.pop(sample, None)
            if sample[0] < self.steps:  # what the report counts: the steps trained
                ended = self.episode(sample).ended
                self.endings[ended] = self.endings.get(ended, 0) + 1

    # ---- tool calls (agentic episodes) ----
    def _call_tool(self, index: int, sample) -> None:
        """A turn ended in a tool call: the controller queues it for a tool runner."""
        inst, episode = self.instances[index], self.episode(sample)
        turns = self._calls_done.get(sample, 0) + 1
        self.feed(ToolCalled(sample, index, inst.waiting[sample], turns, sum(episode.turns[:turns])))

    def _run_tool(self, a: RunTool) -> None:
        """The call runs on its runner for its drawn latency (capped at the tool's timeout)."""
        call = self.episode(a.sample).calls[self._calls_done.get(a.sample, 0)]
        end = self.now + call.seconds
        self.ledger.spans.append(Span(f"tools[{a.runner}]", self.now, end, "tool", call.tool,
                                      f"sample {'/'.join(map(str, a.sample))}"))
        self.tool_calls += a.sample[0] < self.steps
        self.at(end, "tool", a.runner, a.sample)

    def _at_tool(self, runner: int, sample) -> None:
        self._calls_done[sample] = done = self._calls_done.get(sample, 0) + 1
        episode = self.episode(sample)
        timed_out = done == len(episode.calls) and episode.ends_on_call
        self.feed(ToolReturned(sample, runner, "timeout" if timed_out else "ok"))

    def _resume_episode(self, a: ResumeEpisode) -> None:
        home = self.instances[a.home]
        if a.instance == a.home and not self._ends_on_call(a.sample):
            home.resume(self.now, a.sample)
            self._schedule_instance(home)
            return
        # the engine reads the message when the decode step (or stall) under way ends
        self.at(home.reads_inbox_at(self.now), "handoff", a)

    def _ends_on_call(self, sample) -> bool:
        episode = self.episode(sample)
        return self._calls_done[sample] == len(episode.calls) and episode.ends_on_call

    def _at_handoff(self, a: ResumeEpisode) -> None:
        """The episode ends on its call (a timeout), or moves: its history re-prefilled on the other instance."""
        home = self.instances[a.home]
        self._at_instance(a.home, home.generation)  # what the step just ended finished reports first
        if self._ends_on_call(a.sample):
            home.end_on_tool(self.now, a.sample)
            self._finish(a.home, [a.sample])
            if home.static and not home.live:
                self.feed(InstanceIdle(a.home, home.capacity))
        else:
            target = self.instances[a.instance]
            target.adopt(self.now, a.sample, *home.detach(self.now, a.sample))
            self._schedule_instance(target)
        self._schedule_instance(home)

    def _load(self, a: SyncWeights) -> None:
        inst = self.instances[a.instance]
        seconds = self.pricing.load(inst.devices, a.interrupt)
        end = inst.load_weights(self.now, seconds, a.interrupt)
        start = inst.segments[-1][0]  # the load's own segment, whose end holds a re-prefill too
        self.loads.append((start, start + seconds))
        self.at(end, "loaded", a.instance, a.version)
        self._schedule_instance(inst)

    def _loading(self) -> bool:
        """Whether an instance is loading weights now (on separate pools: the trainer's broadcast on
        the network); the windows that ended are dropped."""
        self.loads = [(start, end) for start, end in self.loads if end > self.now]
        return any(start <= self.now for start, _ in self.loads)

    def _at_loaded(self, index: int, version: int) -> None:
        self.feed(WeightsLoaded(index, version))
        self._schedule_instance(self.instances[index])

    # ---- the time-shared pool ----
    def _switch(self, a: SwitchPool) -> None:
        if a.mode == "learn":  # what generation still runs there pauses (carry-over) after the step under way
            for inst in self.instances:
                self.at(inst.reads_inbox_at(self.now), "suspend", inst.index)
        self.modes[a.pool].append((self.now, "switching"))
        seconds = self.pricing.switch(max(ex.devices for ex in self.executors if ex.spec.time_shared))
        self.switch_spans.append((self.now, self.now + seconds, a.pool))
        self.at(self.now + seconds, "switched", a.pool, a.mode)

    # ---- runtime rebalancing: a generation instance joins or leaves the trainer ----
    def _move(self, a: MoveInstance) -> None:
        """Offload one side and onload the other on the trainer's and the instance's devices, priced
        as a sync; while lent, the instance's devices are a data-parallel rank group of the trainer."""
        ex, devices = self._trainer(), self.instances[a.instance].devices
        self.moves.append((self.now, a.instance, a.role))
        if a.role == "learn":
            ex.lent += devices
            self.lent_spans.setdefault(a.instance, []).append([self.now, float("inf")])
        seconds = self.pricing.move(ex.devices + ex.lent)
        if a.role == "gen":  # queued first: the trainer is narrowed before it hears of the move
            self.at(self.now + seconds, "returned", ex, a.instance)
        label = f"move {self.gen_stage.name}[{a.instance}] to {'the trainer' if a.role == 'learn' else 'generation'}"
        self._occupy(ex, seconds, "sync", label, InstanceMoved(a.instance, a.role))

    def _at_returned(self, ex: ExecutorState, instance: int) -> None:
        ex.lent -= self.instances[instance].devices
        self.lent_spans[instance][-1][1] = self.now

    def _at_suspend(self, index: int) -> None:
        """The instance reads the switch between two decode steps: what that step finished first."""
        inst = self.instances[index]
        self._at_instance(index, inst.generation)
        inst.suspend(self.now)

    def _at_switched(self, pool: str, mode: str) -> None:
        self.modes[pool].append((self.now, mode))
        if mode == "gen":
            for inst in self.instances:
                inst.wake(self.now)
        self.feed(PoolSwitched(pool, mode))


def _widened(stage: StagePlan, lent: int) -> StagePlan:
    """A stage on the trainer's executor with `lent` more devices: more data-parallel ranks
    (rebalance.py lends only whole multiples of tp x pp x cp)."""
    if not lent:
        return stage
    p = stage.parallel
    return dataclasses.replace(stage, parallel=dataclasses.replace(p, dp=p.dp + lent // (p.tp * p.pp * p.cp)))
