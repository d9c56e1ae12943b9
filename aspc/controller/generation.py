"""The generation side of the controller: released units, per-instance queues, in-flight
requests, the staleness gate and weight-sync bookkeeping."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from operator import attrgetter

from aspc.controller.config import ControllerConfig
from aspc.controller.dispatch import Load, choose_instance, steals
from aspc.controller.events import Dispatch, Request, SampleId

_queue_of = attrgetter("queue")  # asked of every instance after every event: no Python frame per instance


@dataclass
class InstanceState:
    capacity: int = 0
    loaded: int = 0  # policy version it generates with
    live: bool = True
    pending_sync: int | None = None  # a version it must load before taking new work
    syncing: int | None = None  # the version a SyncWeights action is loading
    queue: deque = field(default_factory=deque)  # units: lists of (sample, prompt_len, predicted)
    inflight: dict = field(default_factory=dict)  # sample -> predicted tokens
    queued_requests: int = 0
    queued_work: float = 0.0
    inflight_work: float = 0.0
    on_tool: set = field(default_factory=set)  # in-flight episodes waiting on a tool call (KV kept)
    deferred: list = field(default_factory=list)  # episodes whose tool answered, resumed after its weight sync
    away: bool = False  # lent to the trainer, or draining to be lent (runtime rebalancing): takes no work

    @property
    def load(self) -> float:
        return self.queued_work + self.inflight_work

    def decoding(self) -> bool:
        """Whether some in-flight request is inside a model turn (not at a turn boundary)."""
        return len(self.inflight) > len(self.on_tool) + len(self.deferred)

    def push(self, unit: list, position: int | None = None) -> None:
        self.queue.insert(len(self.queue) if position is None else position, unit)
        self.queued_requests += len(unit)
        self.queued_work += sum([r[2] for r in unit])

    def remove(self, index: int) -> list:
        unit = self.queue[index]
        del self.queue[index]
        self.queued_requests -= len(unit)
        self.queued_work -= sum([r[2] for r in unit])
        return unit


class Generation:
    def __init__(self, config: ControllerConfig, prompt_len: Callable[[int, int], int], start_version: int = 0) -> None:
        self.config = config
        self.prompt_len = prompt_len
        self.instances = [InstanceState(loaded=start_version) for _ in range(config.instances)]
        self.inflight: dict[SampleId, int] = {}
        self.start_version: dict[SampleId, int] = {}
        self.splits: dict[SampleId, int] = {}
        self.history: dict[tuple[int, int], list[int]] = {}
        self.finished_lengths = 0
        self.finished_count = 0
        self.finished_turns = 0
        self.released_steps = start_version
        self.open: dict[int, int] = {}  # step -> its released samples not finished (queued or in flight), if any
        self.trained = start_version  # optimizer steps done: the next step to train is this one
        self.routed = 0
        self.paused = False  # the time-shared pool belongs to the learner (or is changing hands)
        self.time_shared = config.shared_pool is not None  # read once: dispatch asks after every event
        self.may_steal = steals(config.policy)

    # -- prediction of queued work (queue-aware dispatch) --
    def predicted(self, sample: SampleId, prompt_len: int) -> float:
        lengths = self.history.get(sample[:2])
        if lengths:
            response = sum(lengths) / len(lengths)
        elif self.finished_count:
            response = self.finished_lengths / self.finished_count
        else:
            response = self.config.max_response / 4
        return prompt_len + response

    def loads(self) -> list[Load]:
        return [Load(i, inst.live and not inst.away, inst.queued_requests, len(inst.inflight), inst.queued_work,
                     inst.inflight_work) for i, inst in enumerate(self.instances)]

    # -- release under the staleness gate --
    def release(self, version: int, opening=None) -> None:
        """`opening(step)`: how many prompts a step opens with (dynamic sampling); default prompts_per_step."""
        c = self.config
        self.trained = version
        while self.released_steps < c.steps and c.phase_start(self.released_steps) - c.staleness <= version:
            step = self.released_steps
            self.release_prompts(step, range(opening(step) if opening else c.prompts_per_step))
            self.released_steps += 1

    def release_prompts(self, step: int, prompts) -> None:
        c = self.config
        for prompt in prompts:
            length = self.prompt_len(step, prompt)
            predicted = self.predicted((step, prompt, 0), length)  # the same for the whole group
            samples = [((step, prompt, g), length, predicted) for g in range(c.group)]
            self.open[step] = self.open.get(step, 0) + c.group
            units = [samples] if c.group_affinity else [[s] for s in samples]
            for unit in units:
                self.route(unit)

    def cancel(self, step: int) -> list[int]:
        """Drop the step's queued units (dynamic sampling: the step is full); the prompts none of
        whose samples started."""
        dropped = set()
        for inst in self.instances:
            for index in reversed(range(len(inst.queue))):
                if inst.queue[index][0][0][0] == step:
                    unit = inst.remove(index)
                    self._close(step, len(unit))
                    dropped |= {r[0][1] for r in unit}
        return sorted(dropped - {s[1] for s in self.start_version if s[0] == step})

    def route(self, unit: list) -> None:
        """Queue a unit on the policy's instance, in step order (re-queued work of an old step
        goes ahead of newer steps, so the staleness gate cannot block it behind them)."""
        target = choose_instance(self.config.policy, self.loads(), self.routed)
        self.routed += 1
        inst = self.instances[target]
        step = unit[0][0][0]
        position = len(inst.queue)
        while position > 0 and inst.queue[position - 1][0][0][0] > step:
            position -= 1
        inst.push(unit, position)

    # -- dispatch --
    def dispatchable(self, unit: list, inst: InstanceState) -> bool:
        step = unit[0][0][0]
        return self.config.phase_start(step) - self.config.staleness <= inst.loaded \
            and not self._behind_its_tail(step, inst)

    def _behind_its_tail(self, step: int, inst: InstanceState) -> bool:
        """Tail first: an instance still decoding samples of the next step to train takes no work
        more than one step ahead of it. Those samples are what the learner waits for, and every
        sequence added to their batch slows each of their decode steps (more KV to read); without
        this rule a looser staleness bound filled these batches with newer steps and was slower
        (dapo_32b: 1006 s a step at staleness 2 against 965 at 1; docs/simulator.md). Not on a pool
        generation time-shares with the learner: nothing trains while it generates, so holding work
        back only makes the generation phase do less (r1_zero_671b at staleness 2: 389 s a step with
        the rule, 370 without)."""
        if self.time_shared or step <= self.trained + 1:
            return False
        return any(s[0] <= self.trained for s in inst.inflight)

    def dispatch_all(self, only: int | None = None) -> list[Dispatch]:
        """Fill free capacity (of every instance, or of `only`) from the queues."""
        actions: list[Dispatch] = []
        if self.paused:
            return actions
        if only is not None and len(self.instances[only].inflight) >= self.instances[only].capacity:
            return actions  # full: it neither takes nor steals (the common case after a finish)
        if not any(map(_queue_of, self.instances)):  # nothing queued: nothing to start
            return actions
        for i in range(len(self.instances)) if only is None else (only,):
            inst = self.instances[i]
            if not inst.live or inst.away or inst.pending_sync is not None:
                continue
            requests = self._take(i, inst)
            while len(inst.inflight) < inst.capacity and self.may_steal and self._steal(i):
                requests += self._take(i, inst)
            if requests:
                actions.append(Dispatch(i, tuple(requests)))
        return actions

    def _steal(self, thief: int) -> bool:
        """Move the newest unit the thief may run from the most loaded queue, if that evens the two
        instances' predicted work (queued and in flight) out; False if none. Without the balance
        rule an instance done loading weights emptied the queue of a peer still loading, and the
        peer then idled while the thief's batch held the whole step (issue 15). Queues are in step
        order, so a queue whose head the thief cannot run holds nothing for it."""
        inst = self.instances[thief]
        if inst.queue:
            return False
        candidates = [(other.queued_work, -j) for j, other in enumerate(self.instances)
                      if j != thief and other.queue and self.dispatchable(other.queue[0], inst)]
        if not candidates:
            return False
        other = self.instances[-max(candidates)[1]]
        index = max(k for k, unit in enumerate(other.queue) if self.dispatchable(unit, inst))
        work = sum([r[2] for r in other.queue[index]])
        if inst.inflight and inst.load + work > other.load * (1 + 1e-9):  # it would raise the larger of the two
            return False
        inst.push(other.remove(index))
        return True

    def _take(self, i: int, inst: InstanceState) -> list[Request]:
        """Requests from the head of the queue while the instance has room. A unit is dispatchable
        or not as a whole (its step decides), so what fits of it is taken at once."""
        requests = []
        queue, inflight, where, versions = inst.queue, inst.inflight, self.inflight, self.start_version
        while queue and len(inflight) < inst.capacity and self.dispatchable(queue[0], inst):
            unit = queue[0]
            room = inst.capacity - len(inflight)
            taken = unit[:room]
            del unit[:room]
            if not unit:
                queue.popleft()
            inst.queued_requests -= len(taken)
            queued, running, loaded = inst.queued_work, inst.inflight_work, inst.loaded  # locals: per request
            new = tuple.__new__  # a Request without its Python __new__
            for sample, prompt_len, predicted in taken:
                queued -= predicted
                inflight[sample] = predicted
                running += predicted
                where[sample] = i
                requests.append(new(Request, (sample, prompt_len, versions.setdefault(sample, loaded))))
            inst.queued_work, inst.inflight_work = queued, running
        return requests

    def finish(self, instance: int, finished) -> list[SampleId]:
        """Record the instance's finished samples (SampleFinished events), in order; the samples that
        were not stale (their instance failed meanwhile). Locals for the loop: the simulator reports
        hundreds of thousands."""
        inst, where, history, done = self.instances[instance], self.inflight, self.history, []
        inflight, work = inst.inflight, inst.inflight_work
        lengths_sum, turns_sum, open_samples = self.finished_lengths, self.finished_turns, self.open
        for sample, _, length, turns in finished:
            if where.get(sample) != instance:
                continue
            del where[sample]
            left = open_samples[sample[0]] = open_samples[sample[0]] - 1
            if not left:
                del open_samples[sample[0]]
            work -= inflight.pop(sample)
            history.setdefault(sample[:2], []).append(length)
            lengths_sum += length
            turns_sum += turns
            done.append(sample)
        inst.inflight_work = work
        self.finished_lengths, self.finished_turns = lengths_sum, turns_sum
        self.finished_count += len(done)
        return done

    def complete_through(self, step: int) -> bool:
        """Every released sample of the steps up to `step` has finished (and `step` was released)."""
        return self.released_steps > step and not any(s <= step for s in self.open)

    def _close(self, step: int, samples: int) -> None:
        left = self.open[step] = self.open[step] - samples
        if not left:
            del self.open[step]

    # -- agentic episodes --
    def remaining(self, turns: int, generated: int) -> float:
        """Predicted model tokens an episode still writes after `turns` turns: the turns finished
        episodes took on average, at their mean tokens per turn (at least one more turn)."""
        if self.finished_count:
            expected_turns = self.finished_turns / self.finished_count
            per_turn = self.finished_lengths / max(self.finished_turns, 1)
        else:
            expected_turns, per_turn = turns + 1, generated / max(turns, 1)
        return max(expected_turns - turns, 1.0) * per_turn

    def tool_called(self, sample: SampleId, instance: int, turns: int, generated: int) -> None:
        """The episode waits on a tool; what it still holds of its instance is its predicted rest."""
        inst = self.instances[instance]
        inst.on_tool.add(sample)
        self._predict(inst, sample, self.remaining(turns, generated))

    def _predict(self, inst: InstanceState, sample: SampleId, predicted: float) -> None:
        inst.inflight_work += predicted - inst.inflight[sample]
        inst.inflight[sample] = predicted

    def resume_target(self, sample: SampleId, home: int, context: int) -> int:
        """Where an episode whose tool answered goes on: the instance that holds its KV prefix
        (sticky). Queue-aware dispatch moves it only where its slot is what holds work back: the
        home instance is full with requests queued behind it, and a peer on the same weights has a
        free slot, nothing queued, and less work even with this episode's rest and its history to
        re-prefill (a prefill that stalls the peer's batch; a looser rule made agentic_7b slower)."""
        inst = self.instances[home]
        if not steals(self.config.policy) or not inst.queue or len(inst.inflight) < inst.capacity:
            return home
        rest = inst.inflight[sample]
        peers = [(other.load, j) for j, other in enumerate(self.instances)
                 if j != home and other.live and not other.away and other.pending_sync is None
                 and other.syncing is None
                 and other.loaded == inst.loaded and len(other.inflight) < other.capacity and not other.queue]
        if not peers:
            return home
        load, target = min(peers)
        return target if load + rest + context < inst.load else home

    def move(self, sample: SampleId, home: int, target: int, context: int) -> None:
        """The episode leaves `home` (its slot freed) and runs on `target`, which re-prefills its history."""
        source, dest = self.instances[home], self.instances[target]
        rest = source.inflight.pop(sample)
        source.inflight_work -= rest
        dest.inflight[sample] = rest + context
        dest.inflight_work += rest + context
        self.inflight[sample] = target

    def leave(self, instance: int) -> None:
        """The instance takes no more work (runtime rebalancing lends it to the trainer once what it
        runs has finished); what is queued on it goes to the others."""
        inst = self.instances[instance]
        inst.away = True
        inst.pending_sync = None
        for unit in [inst.remove(0) for _ in range(len(inst.queue))]:
            self.route(unit)

    def drained(self, instance: int) -> bool:
        inst = self.instances[instance]
        return not inst.inflight and inst.syncing is None

    def fail(self, instance: int) -> None:
        """Re-queue what a failed instance held; the work it did is lost and is redone."""
        inst = self.instances[instance]
        inst.live = False
        lost = sorted(inst.inflight.items())
        for sample, _ in lost:
            del self.inflight[sample]
            self.start_version.pop(sample, None)
        inst.inflight.clear()
        inst.on_tool.clear()
        inst.deferred.clear()
        inst.inflight_work = 0.0
        units = [inst.remove(0) for _ in range(len(inst.queue))]
        units += [[(s, self.prompt_len(*s[:2]), p)] for s, p in lost]
        for unit in units:
            self.route(unit)
