"""Runtime rebalancing: the controller lends flexible generation instances to the trainer when
generation starves at the staleness gate, and takes them back when the learner starves for
samples (docs/simulator.md, "Runtime rebalancing").

The controller has no clock, so starvation is measured in the other side's progress, which is
what the starving side waits for:
- the learner starves: the share of the step's generation time that ended while the trainer sat
  idle with nothing it may run. Generation time is counted in decode steps: each instance has a
  decode-step clock, a request starts at the clock's reading when it is dispatched and ends
  response-length steps later, and a finish that moves the clock on adds that many steps (a
  long tail decoded by a few sequences counts for its steps, not for its few tokens);
- generation starves: the share of the generating instances that sat idle (nothing in flight,
  nothing they may take) while the staleness gate held the next step back, averaged over the
  trainer's work of the step (its units by samples, a train pass counted as three forward
  passes), between the state where a unit starts and where it ends.
A move is decided at a step boundary (a weight publish) and needs the same verdict `window`
steps in a row (hysteresis; the first step, which starts with an idle learner, is not counted).
It must also pay: with a starving share s of the busy side's time, the other side's time is
(1 - s) of it, and a move is taken only if that side, grown by the devices it loses, still ends
sooner by `margin` — so a move never just swaps the bottleneck, and the steady state after a
move does not ask for the reverse. The move itself (offload, onload, the weight sync of a
returned instance) is priced by the drivers as a sync on the trainer's and the instance's devices.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from aspc.plan.execution_plan import ExecutionPlan, StagePlan, StageRefusal

WINDOW = 2  # steps in a row with the same verdict before a move
MARGIN = 0.05  # the share of the step a move must save, beyond what it costs the other side


@dataclass(frozen=True)
class RebalancePolicy:
    flexible: tuple[int, ...]  # generation instances whose devices can hold a trainer data-parallel rank
    instance_devices: tuple[int, ...]  # devices of each generation instance
    trainer_devices: int  # the trainer's own devices
    window: int = WINDOW
    margin: float = MARGIN


def rebalance_policy(plan: ExecutionPlan) -> RebalancePolicy | None:
    """The plan's flexible instances, or None when no instance can join the trainer: generation
    must have devices of its own (not time-shared with the trainer's) and more than one instance
    (one always keeps generating); a flexible instance is on the trainer's hardware and holds whole
    data-parallel ranks of it (tp x pp x cp devices each) that keep expert parallelism's ep
    dividing tp x cp x dp. Each rank holds what the trainer's other ranks hold: it fits where they fit."""
    gen, train = plan.stages_of("generate")[0], plan.stages_of("train")[0]
    if _time_shared(gen, train) or gen.pool is None or train.pool is None or len(gen.instances) < 2:
        return None
    if plan.pool(gen.pool).hardware != plan.pool(train.pool).hardware:
        return None
    flexible = tuple(i.index for i in gen.instances if _joins(i.device_count, train))
    if not flexible:
        return None
    trainer = sum(i.device_count for i in train.instances)
    return RebalancePolicy(flexible, tuple(i.device_count for i in gen.instances), trainer)


def _time_shared(gen: StagePlan, train: StagePlan) -> bool:
    devices = {d for i in gen.instances for d in i.devices}
    return gen.pool == train.pool and any(d in devices for i in train.instances for d in i.devices)


def _joins(devices: int, train: StagePlan) -> bool:
    """Whether `devices` make whole data-parallel ranks of the trainer that expert parallelism can use."""
    rank, p = _rank_devices(train), train.parallel
    return devices > 0 and devices % rank == 0 and (p.tp * p.cp * (devices // rank)) % p.ep == 0


def _rank_devices(stage: StagePlan) -> int:
    p = stage.parallel
    return p.tp * p.pp * p.cp


def refusal(plan: ExecutionPlan) -> StageRefusal | None:
    """`rebalance = true` with nothing to move: refused at the generate stage, never ignored."""
    gens, trains = plan.stages_of("generate"), plan.stages_of("train")
    if not plan.rebalance or len(gens) != 1 or len(trains) != 1 or rebalance_policy(plan) is not None:
        return None
    return StageRefusal(gens[0].name, f"stage '{gens[0].name}': schedule option rebalance = true, but "
                        f"{why_not_flexible(plan)}", "give generation a pool of its own and two or more "
                        "instances, each of whole trainer data-parallel ranks; or leave rebalance out")


def why_not_flexible(plan: ExecutionPlan) -> str:
    """Why `rebalance = true` has nothing to move."""
    gen, train = plan.stages_of("generate")[0], plan.stages_of("train")[0]
    if _time_shared(gen, train):
        return "generation time-shares its devices with the trainer (the pool already switches between them)"
    if len(gen.instances) < 2:
        return f"stage '{gen.name}' has one instance, and one instance always keeps generating"
    if gen.pool is None or train.pool is None or plan.pool(gen.pool).hardware != plan.pool(train.pool).hardware:
        return "generation and training run on different hardware"
    return (f"no instance of stage '{gen.name}' has a multiple of the {_rank_devices(train)} devices "
            f"of one data-parallel rank of stage '{train.name}' (tp x pp x cp) that keeps its ep "
            f"dividing tp x cp x dp")


@dataclass
class StepShares:
    learner_starved: float  # share of the step's decode steps that ended while the trainer idled
    gen_starved: float  # mean share of generating instances idle at the staleness gate


class Rebalancer:
    """Observes starvation between step boundaries and decides moves at them. Which instances
    are lent is its state; core.py carries the decisions into the generation and device queues."""

    def __init__(self, policy: RebalancePolicy):
        self.policy = policy
        self.lent: list[int] = []  # instances serving the trainer, in the order they were lent
        self.leaving: set[int] = set()  # instances draining before they are lent
        self.history: deque[StepShares] = deque(maxlen=policy.window)
        self.clock = [0.0] * len(policy.instance_devices)  # each instance's decode steps so far
        self.started: dict = {}  # request -> its instance's decode clock when it was dispatched
        self._reset()

    def _reset(self) -> None:
        self.decode_steps = self.starved_steps = 0.0
        self.learner_items = 0.0  # the trainer's work, in forward passes of a sample
        self.gated = 0.0
        self.last_gate = 0.0

    def away(self) -> set[int]:
        """Instances that do not generate: lent, or draining to be lent."""
        return set(self.lent) | self.leaving

    # -- observations, before each event is handled --
    def dispatched(self, instance: int, samples) -> None:
        for sample in samples:
            self.started[sample] = self.clock[instance]

    def sample_finished(self, instance: int, sample, tokens: int, learner_idle: bool) -> None:
        end = self.started.pop(sample, self.clock[instance]) + tokens
        steps = max(0.0, end - self.clock[instance])
        self.clock[instance] += steps
        self.decode_steps += steps
        self.starved_steps += steps * learner_idle

    def trainer_progress(self, passes: float, gate_idle: float) -> None:
        """The trainer finished `passes` of work; generation was `gate_idle` idle at its end."""
        self.learner_items += passes
        self.gated += passes * (self.last_gate + gate_idle) / 2
        self.last_gate = gate_idle

    def new_layout(self) -> None:
        """A move was carried out: judge the new layout afresh."""
        self.history.clear()
        self._reset()

    # -- decisions, at a step boundary --
    def step_boundary(self, version: int, steps: int) -> tuple[str, int] | None:
        """("learn", instance) to lend, ("gen", instance) to take back, or None."""
        shares = StepShares(self.starved_steps / max(self.decode_steps, 1), self.gated / max(self.learner_items, 1))
        self._reset()
        if version <= 1:  # the first step starts with an idle learner: not a verdict
            return None
        self.history.append(shares)
        if self.leaving or len(self.history) < self.policy.window or steps - version <= self.policy.window:
            return None
        decision = self._lend() or self._take_back()
        if decision is not None:
            self.history.clear()
        return decision

    def _lend(self) -> tuple[str, int] | None:
        generating = [i for i in range(len(self.policy.instance_devices)) if i not in self.away()]
        candidates = [i for i in self.policy.flexible if i in generating]
        if len(generating) < 2 or not candidates:
            return None
        instance = candidates[-1]
        devices = self._devices(generating)
        slower = devices / (devices - self.policy.instance_devices[instance])
        if all(self._pays(s.gen_starved, slower) for s in self.history):
            self.leaving.add(instance)
            return "learn", instance
        return None

    def _take_back(self) -> tuple[str, int] | None:
        if not self.lent:
            return None
        instance = self.lent[-1]
        trainer = self.policy.trainer_devices + self._devices(self.lent)
        slower = trainer / (trainer - self.policy.instance_devices[instance])
        if all(self._pays(s.learner_starved, slower) for s in self.history):
            return "gen", instance
        return None

    def _pays(self, starved: float, slower: float) -> bool:
        """The side that idles a `starved` share of the other's time, made `slower` by the move,
        still finishes before the other side by the margin."""
        return (1.0 - starved) * slower <= 1.0 - self.policy.margin

    def _devices(self, instances) -> int:
        return sum(self.policy.instance_devices[i] for i in instances)

    # -- the moves carried out --
    def moved(self, instance: int, role: str) -> None:
        if role == "learn":
            self.leaving.discard(instance)
            self.lent.append(instance)
        else:
            self.lent.remove(instance)
