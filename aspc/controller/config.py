"""What the controller needs to know, read from an execution plan."""
from __future__ import annotations

import math
from dataclasses import dataclass

from aspc.controller.kinds import rule_for
from aspc.controller.rebalance import RebalancePolicy, rebalance_policy, why_not_flexible
from aspc.controller.scoring import CallPolicy
from aspc.plan.execution_plan import ExecutionPlan, StagePlan


class UnsupportedPlan(Exception):
    """The runtime cannot execute this plan shape (said with what to change)."""


@dataclass(frozen=True)
class RoutedStage:
    """A stage the controller sends streamed units to after generation: a forward stage or training."""

    name: str
    kind: str
    role: str | None  # the executor role that runs it; None: on the host, by the driver itself
    per_group: bool = False  # scores each group as it completes (a reward model or judge on its own devices)
    calls: CallPolicy | None = None  # a judge's calls: timeout, concurrency, fallback (scoring.py)


@dataclass(frozen=True)
class ExecutorSpec:
    """Devices that run one thing at a time: every (stage, instance) placed on them.

    Stages whose instances overlap on a pool's devices share an executor (time-shared); disjoint
    placements get their own and run side by side."""

    name: str  # the trace track: the pool, or pool[k] when the pool has several executors
    pool: str
    devices: tuple[int, ...]
    hosts: tuple[tuple[str, int], ...]  # (stage, instance index)
    time_shared: bool  # shares its devices with generation instances (the pool switches between them)


@dataclass(frozen=True)
class ControllerConfig:
    steps: int
    prompts_per_step: int
    group: int
    instances: int
    staleness: int
    policy: str
    group_affinity: bool
    stream_micro: int | None  # samples per streamed unit; None: a barrier on the whole step
    partial_rollout: int  # max splits of one sample at weight syncs; 0: drain before a sync
    forward_stages: tuple[RoutedStage, ...]  # run on each unit before training, in plan order
    train_stage: str
    max_response: int
    executors: tuple[ExecutorSpec, ...] = ()
    gen_pool: str | None = None
    checkpoint_every: int = 0
    tool_workers: int = 0  # an environment's tool runners (its tool calls run on them); 0: no environment
    rebalance: RebalancePolicy | None = None  # runtime rebalancing (rebalance.py); None: off
    max_prompts: int = 0  # dynamic sampling: prompts one step may generate (dynamic_sampling.py); 0: off
    stop_at_bound: bool = False  # dynamic sampling: a step at max_prompts ends the run instead of padding
    train_whole_step: bool = False  # advantages whitened over the step: its units train once all are ready
    mini_batches: int = 1  # optimizer steps per generation phase (the train stage's mini_batches)

    def phase_start(self, step: int) -> int:
        """The first step of the generation phase `step` belongs to: its prompts are released, and
        may be dispatched, with the weights of that step (mini_batches steps share a phase)."""
        return step - step % self.mini_batches

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group

    @property
    def filters_groups(self) -> bool:
        return self.max_prompts > 0

    @property
    def prompt_stride(self) -> int:
        """Data rows per step: a step's prompt p is row step x stride + p (its extra prompts under
        dynamic sampling follow its own prompts_per_step, before the next step's)."""
        return max(self.prompts_per_step, self.max_prompts)

    def data_row(self, step: int, prompt: int) -> int:
        return step * self.prompt_stride + prompt

    @property
    def shared_pool(self) -> str | None:
        """The pool generation time-shares with learner-side executors (None: disaggregated)."""
        return self.gen_pool if any(e.time_shared for e in self.executors) else None

    def executor_of(self, stage: str, instance: int = 0) -> int:
        return next(k for k, e in enumerate(self.executors) if (stage, instance) in e.hosts)

    @staticmethod
    def from_plan(plan: ExecutionPlan, steps: int, checkpoint_every: int = 0) -> ControllerConfig:
        generators, trainers = plan.stages_of("generate"), plan.stages_of("train")
        if len(generators) != 1 or len(trainers) != 1:
            raise UnsupportedPlan("the runtime executes one generate and one train stage; this plan has "
                                  f"{len(generators)} and {len(trainers)}")
        gen, train = generators[0], trainers[0]
        data = plan.dataset_of(gen)
        dispatch = next((d for d in plan.dispatches if d.target == gen.name), None)
        routed = [s for s in plan.stages if rule_for(s).before_train]
        on_devices = [s for s in routed if rule_for(s).on_devices] + [train]
        executors = _executors(on_devices, gen)
        max_prompts = _max_prompts(train, data, routed)
        forward = tuple(RoutedStage(s.name, s.kind, rule_for(s).role,  # filtering decides on each group's rewards
                                    _scores_as_finished(s, executors) or (bool(max_prompts) and s.kind == "reward"),
                                    CallPolicy.of(s)) for s in routed)
        environments = plan.stages_of("environment")
        return ControllerConfig(
            steps=steps, prompts_per_step=data.prompts_per_step, group=data.group,
            instances=len(gen.instances), staleness=_staleness_gate(plan, train),
            policy=dispatch.policy if dispatch else "round_robin",
            group_affinity=dispatch.group_affinity if dispatch else True,
            stream_micro=train.stream_micro, partial_rollout=gen.partial_rollout,
            forward_stages=forward, train_stage=train.name, max_response=data.max_response,
            executors=executors, gen_pool=gen.pool, checkpoint_every=checkpoint_every,
            tool_workers=dict(environments[0].options)["tool_workers"] if environments else 0,
            max_prompts=max_prompts, stop_at_bound=dict(train.options).get("at_oversample_bound") == "stop",
            rebalance=_rebalancing(plan), train_whole_step=whitens_over_step(plan),
            mini_batches=dict(train.options).get("mini_batches", 1))


def whitens_over_step(plan: ExecutionPlan) -> bool:
    """PPO's GAE advantages whitened (`normalize = true`) over the step's every sample, as under
    sync: a unit's policy loss needs the step's statistics, so the step's units train together once
    the last is ready (its forward stages still stream), and asp optimises sync's objective."""
    advantage = next(iter(plan.stages_of("advantage")), None)
    options = dict(advantage.options) if advantage is not None else {}
    return options.get("estimator") == "gae" and bool(options.get("normalize"))


def _staleness_gate(plan: ExecutionPlan, train: StagePlan) -> int:
    """The bound the generation gate holds: the staleness of the channel (async-decouple's) the
    train stage's responses come through, whose capacity is (staleness + 1) steps; no channel: 0,
    on-policy (the sync schedules)."""
    source = dict(train.inputs).get("responses")
    channel = next((c for c in plan.channels if c.name == source), None)
    return channel.staleness if channel is not None else 0


def _rebalancing(plan: ExecutionPlan) -> RebalancePolicy | None:
    if not plan.rebalance:
        return None
    policy = rebalance_policy(plan)
    if policy is None:
        raise UnsupportedPlan(f"rebalance = true, but {why_not_flexible(plan)}")
    return policy


def _max_prompts(train: StagePlan, data, routed: list[StagePlan]) -> int:
    """Dynamic sampling's bound on the prompts of one step (0: off)."""
    options = dict(train.options)
    if not options.get("filter_groups"):
        return 0
    if not any(s.kind == "reward" for s in routed):
        raise UnsupportedPlan("filter_groups decides on a reward stage's scores, and this plan has none")
    if data.group < 2:
        raise UnsupportedPlan(f"filter_groups drops groups whose rewards are all equal, and data '{data.name}' "
                              "has group = 1 (every group would be): set group to 2 or more")
    return max(data.prompts_per_step, math.ceil(data.prompts_per_step * options["max_oversample"] - 1e-9))


def _scores_as_finished(stage: StagePlan, executors: tuple[ExecutorSpec, ...]) -> bool:
    """A reward model or judge scores each group as it completes when its devices are its own
    (shared with generation, it would switch the pool once per group; shared with the trainer, it
    would queue between training units): then its pool works while generation goes on."""
    if rule_for(stage).role not in ("forward_model", "judge"):
        return False
    mine = [e for e in executors if any(host == stage.name for host, _ in e.hosts)]
    return all(not e.time_shared and all(host == stage.name for host, _ in e.hosts) for e in mine)


def _executors(stages: list[StagePlan], gen: StagePlan) -> tuple[ExecutorSpec, ...]:
    """Group (stage, instance) placements whose devices overlap on a pool, in plan order."""
    groups: list[tuple[str, set[int], list[tuple[str, int]]]] = []
    for stage in stages:
        assert stage.pool is not None, f"stage '{stage.name}' runs on executors but on no pool"
        for inst in stage.instances:
            devices = set(inst.devices) or {-1 - inst.index}  # a host-placed instance: its own executor
            merged = [g for g in groups if g[0] == stage.pool and g[1] & devices]
            for g in merged:
                groups.remove(g)
                devices |= g[1]
            hosts = [h for g in merged for h in g[2]] + [(stage.name, inst.index)]
            groups.append((stage.pool, devices, sorted(hosts, key=_plan_order(stages))))
    groups.sort(key=lambda g: min(_plan_order(stages)(h) for h in g[2]))
    gen_devices = {d for inst in gen.instances for d in inst.devices}
    per_pool: dict[str, int] = {}
    for pool, _, _ in groups:
        per_pool[pool] = per_pool.get(pool, 0) + 1
    out: list[ExecutorSpec] = []
    seen: dict[str, int] = {}
    for pool, devices, hosts in groups:
        k = seen[pool] = seen.get(pool, -1) + 1
        name = pool if per_pool[pool] == 1 else f"{pool}[{k}]"
        shared = pool == gen.pool and bool(devices & gen_devices)
        out.append(ExecutorSpec(name, pool, tuple(sorted(devices)), tuple(hosts), shared))
    return tuple(out)


def _plan_order(stages: list[StagePlan]):
    order = {s.name: i for i, s in enumerate(stages)}
    return lambda host: (order[host[0]], host[1])
