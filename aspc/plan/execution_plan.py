"""The execution plan: pure, JSON-serializable data — the one thing backends and drivers consume.

Built from a stage graph after the passes: stage instances with their devices and parallel
degrees, channels with capacities, dispatch policies, micro-batch and bucket shapes, the
staleness bound and the weight-sync edges.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, NamedTuple

from aspc.ir.facts import ModelArch
from aspc.ir.graph import Parallel, Stage, StageGraph, StageKind, WeightTransfer
from aspc.ir.kinds import KIND_RULES
from aspc.ir.serialize import decode, encode
from aspc.ir.values import Call

PLAN_FORMAT = "aspc.execution_plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class PoolPlan:
    name: str
    hardware: str
    count: int


@dataclass(frozen=True)
class ModelPlan:
    name: str
    preset: str
    dtype: str
    arch: ModelArch
    frozen_of: str | None
    # weights to load (a path relative to the .aspl file): "" (initialised from a seed) is not written
    checkpoint: str = dataclasses.field(default="", metadata={"omit_if_default": True})


@dataclass(frozen=True)
class DataPlan:
    name: str
    source: str
    location: str
    prompts_per_step: int
    group: int
    max_prompt: int
    max_response: int
    seed: int
    response_lengths: Call | None
    prompt_lengths: Call | None

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group


@dataclass(frozen=True)
class Instance:
    """One copy of a stage on the contiguous devices first_device .. first_device + device_count - 1
    of its pool (device_count 0: a host process)."""

    index: int
    first_device: int
    device_count: int

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.device_count)


@dataclass(frozen=True)
class MicroBatching:
    tokens: int
    buckets: tuple[int, ...]  # static micro-batch sizes; () means dynamic shapes
    balance: str
    padding: str  # "buckets" | "none" (remove-padding) | "longest" (pad to the longest sequence)
    expected_padding_fraction: float | None


@dataclass(frozen=True)
class StagePlan:
    name: str
    kind: str
    model: str | None
    data: str | None
    pool: str | None
    parallel: Parallel
    placement: str  # "dedicated" | "time_shared" | "host"
    instances: tuple[Instance, ...]
    inputs: tuple[tuple[str, str], ...]  # (field, producing stage or channel/dispatch)
    batching: str | None  # generate: "continuous" | "static"
    micro_batching: MicroBatching | None  # train/reference/critic
    stream_micro: int | None  # samples per streamed micro-batch; None: barrier on the whole step
    partial_rollout: int  # generate: max times a sample is split at weight syncs (0: off)
    options: tuple[tuple[str, Any], ...]

    def replays_routes(self) -> bool:
        """A train stage whose policy forward replays the engine's MoE routes (routing_replay = rollout)."""
        return self.kind == "train" and dict(self.options).get("routing_replay", "none") != "none"


@dataclass(frozen=True)
class ChannelPlan:
    name: str
    src: str
    dsts: tuple[str, ...]
    fields: tuple[str, ...]
    capacity: int  # samples
    samples_per_step: int
    staleness: int


@dataclass(frozen=True)
class DispatchPlan:
    name: str
    target: str
    policy: str
    group_affinity: bool
    instances: int


@dataclass(frozen=True)
class WeightSyncPlan:
    name: str
    src: str  # the train stage
    dst: str  # the generate stage
    mode: str  # "sync" (barrier) | "async" (under the staleness bound)
    staleness: int
    bytes: int
    src_layout: str
    dst_layout: str
    reshard: bool
    transfer: str  # "link" | "offload_onload"
    interrupt: bool  # partial rollout: in-flight generations pause at the sync


@dataclass(frozen=True)
class ExecutionPlan:
    pipeline: str
    schedule: str
    passes: str
    staleness: int
    pools: tuple[PoolPlan, ...]
    models: tuple[ModelPlan, ...]
    data: tuple[DataPlan, ...]
    stages: tuple[StagePlan, ...]
    channels: tuple[ChannelPlan, ...]
    dispatches: tuple[DispatchPlan, ...]
    weight_syncs: tuple[WeightSyncPlan, ...]
    # runtime rebalancing of flexible generation instances (aspc/controller/rebalance.py)
    rebalance: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    def stages_of(self, kind: str) -> list[StagePlan]:
        return [s for s in self.stages if s.kind == kind]

    def model(self, name: str) -> ModelPlan:
        return next(m for m in self.models if m.name == name)

    def dataset(self, name: str) -> DataPlan:
        return next(d for d in self.data if d.name == name)

    def dataset_of(self, stage: StagePlan) -> DataPlan:
        """The dataset a stage reads: a generate stage always names one (the checker refuses it otherwise)."""
        assert stage.data is not None, f"stage '{stage.name}' reads no dataset"
        return self.dataset(stage.data)

    def model_of(self, stage: StagePlan) -> ModelPlan:
        """The model a stage runs: a generate, reference, critic or train stage always names one."""
        assert stage.model is not None, f"stage '{stage.name}' runs no model"
        return self.model(stage.model)

    def pool(self, name: str) -> PoolPlan:
        return next(p for p in self.pools if p.name == name)

    def beside_trainer(self, stage: StagePlan) -> bool:
        """Whether every instance of the stage shares devices with the train stage (so the runtime
        runs it on the trainer's executor: ControllerConfig's executors group overlapping
        placements), or some instance has an executor of its own."""
        train = self.stages_of("train")[0]
        trainer_devices = {d for inst in train.instances for d in inst.devices}
        return stage.pool == train.pool and all(set(inst.devices) & trainer_devices for inst in stage.instances)

    def replays_routes(self) -> bool:
        """Whether a train stage replays the engine's MoE routes (routing_replay = rollout): the
        engines must record each token's experts."""
        return any(stage.replays_routes() for stage in self.stages_of("train"))

    def to_json(self) -> str:
        doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, **jsonable(self)}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ExecutionPlan:
        """The plan `to_json` wrote, rebuilt exactly; PlanFormatError names what does not fit."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFormatError(f"execution plan is not JSON: {error}") from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise PlanFormatError(f"not an execution plan: expected \"format\": \"{PLAN_FORMAT}\"")
        if doc.get("version") != PLAN_VERSION:
            raise PlanFormatError(f"execution plan version {doc.get('version')!r}: this aspc reads "
                                  f"version {PLAN_VERSION}; recompile with `aspc compile --emit plan`")
        fields = {k: v for k, v in doc.items() if k not in ("format", "version")}
        return _read(cls, fields, "plan")


_PAIR_FIELDS = ("options", "inputs")  # tuples of (key, value) pairs, written as JSON objects


def jsonable(value: Any) -> Any:
    """Plan dataclasses -> JSON values; Call values in their IR JSON form."""
    if dataclasses.is_dataclass(value) and not isinstance(value, Call):
        return {f.name: ({k: jsonable(v) for k, v in getattr(value, f.name)} if f.name in _PAIR_FIELDS
                         else jsonable(getattr(value, f.name))) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit_if_default") and getattr(value, f.name) == f.default)}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return encode(value)


def _read(hint: Any, value: Any, where: str) -> Any:
    """A JSON value -> the plan type `hint` (dataclass, tuple, optional, scalar); PlanFormatError
    names the path of a value that does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is Call:
        return _decode(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _read(next(a for a in args if a is not type(None)), value, where)
    if dataclasses.is_dataclass(hint):
        return _read_record(hint, value, where)
    if origin is tuple and isinstance(value, dict) and typing.get_origin(args[0]) is tuple:
        value_hint = typing.get_args(args[0])[1]  # (key, value) pairs, written as a JSON object
        return tuple((k, _read(value_hint, v, f"{where}.{k}")) for k, v in value.items())
    if origin is tuple and isinstance(value, list) and args[-1] is Ellipsis:
        return tuple(_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple and isinstance(value, list) and len(value) == len(args):
        return tuple(_read(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if hint in (int, str, bool) and type(value) is hint or hint is float and type(value) in (int, float):
        return value
    raise PlanFormatError(f"{where}: expected {_name(hint)}, found {json.dumps(value)}")


def _decode(hint: Any, value: Any, where: str) -> Any:
    """Option values and length distributions, in the IR's JSON form (a Call is an object)."""
    if hint is Call and not isinstance(value, dict):
        raise PlanFormatError(f"{where}: expected a call object, found {json.dumps(value)}")
    try:
        return decode(value)
    except (KeyError, AttributeError, TypeError):
        raise PlanFormatError(f"{where}: a call object needs \"call\" and \"kwargs\", found "
                              f"{json.dumps(value)}") from None


def _read_record(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise PlanFormatError(f"{where}: expected a {cls.__name__} object, found {json.dumps(value)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in value and _required(cls, n)]
    if missing:
        raise PlanFormatError(f"{where}: {cls.__name__} lacks {', '.join(missing)}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise PlanFormatError(f"{where}: {cls.__name__} has no field {', '.join(unknown)}")
    return cls(**{n: _read(hints[n], v, f"{where}.{n}") for n, v in value.items()})


def _required(cls: type, name: str) -> bool:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _name(hint: Any) -> str:
    if typing.get_origin(hint) is not tuple:
        return getattr(hint, "__name__", str(hint))
    return "a list" if typing.get_args(hint)[-1] is Ellipsis else f"a list of {len(typing.get_args(hint))}"


class StageRefusal(NamedTuple):
    """A stage a backend cannot execute or price: refused before the run, at the stage's line (or
    at `option`'s, when one option causes it), never skipped or counted as free."""

    stage: str
    message: str
    hint: str
    option: str | None = None


class PlanError(Exception):
    """The graph cannot be planned (a pass the plan relies on has not run, or the passes left an
    unsound plan); `hint` says what to do about it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class PlanFormatError(PlanError, ValueError):
    """A plan file that is not JSON, not an execution plan, of another version, or of a wrong shape."""


def build_plan(graph: StageGraph, passes: str) -> ExecutionPlan:
    stages = graph.stages()
    unplaced = [s.name for s in stages if s.pool is not None and s.placement is None]
    if unplaced:
        raise PlanError(f"stages {', '.join(unplaced)} have no devices yet: the execution plan "
                        "needs the `place` pass in the pipeline", "add `place` to the pass pipeline")
    plan = _plan(graph, passes, stages)
    problems = plan_problems(plan)
    if problems:
        raise PlanError("the passes produced an unsound execution plan: " + "; ".join(problems),
                        "a pass of the pipeline is wrong or missing; this is a compiler bug if the "
                        "pipeline is a schedule's own")
    return plan


def _plan(graph: StageGraph, passes: str, stages: list[Stage]) -> ExecutionPlan:
    """The plan's records, read off the graph; build_plan checks them."""
    syncs = [_weight_sync(graph, s) for s in stages if s.kind is StageKind.WEIGHT_SYNC]
    channels = [_channel(graph, s) for s in stages if s.kind is StageKind.CHANNEL]
    return ExecutionPlan(
        pipeline=graph.pipeline, schedule=graph.schedule.kind, passes=passes,
        staleness=max((c.staleness for c in channels), default=0),
        pools=tuple(PoolPlan(p.name, p.hardware.name, p.count) for _, p in sorted(graph.pools.items())),
        models=tuple(ModelPlan(m.name, m.preset, m.dtype, m.arch, m.frozen_of, m.checkpoint)
                     for _, m in sorted(graph.models.items())),
        data=tuple(DataPlan(d.name, d.source, d.location, d.prompts_per_step, d.group, d.max_prompt,
                            d.max_response, d.seed, d.response_lengths, d.prompt_lengths)
                   for _, d in sorted(graph.data.items())),
        stages=tuple(_stage(graph, s) for s in stages if not KIND_RULES[s.kind].inserted),
        channels=tuple(channels),
        dispatches=tuple(_dispatch(s) for s in stages if s.kind is StageKind.DISPATCH),
        weight_syncs=tuple(syncs), rebalance=bool(graph.schedule.option("rebalance")))


def _stage(graph: StageGraph, stage: Stage) -> StagePlan:
    """A stage's plan: its user options as written, and what the passes decided (typed results)."""
    placed = stage.placement if stage.pool else None
    offset = placed.device_offset if placed else 0
    per = stage.parallel.devices if stage.pool else 0
    instances = tuple(Instance(i, offset + i * per, per) for i in range(stage.instances))
    inputs = tuple(sorted((field, src) for field, src in graph.inputs(stage.name).items()))
    batching = (stage.batching.mode if stage.batching else "static") if stage.kind is StageKind.GENERATE else None
    return StagePlan(
        stage.name, stage.kind.value, stage.model, stage.data, stage.pool, stage.parallel,
        placed.kind if placed else "host", instances, inputs, batching, _micro_batching(graph, stage),
        stage.streaming.micro if stage.streaming else None,
        stage.partial_rollout.max_split if stage.partial_rollout else 0, stage.options)


def _micro_batching(graph: StageGraph, stage: Stage) -> MicroBatching | None:
    if not KIND_RULES[stage.kind].packed:
        return None
    shape = stage.micro_batching
    if shape is not None:
        return MicroBatching(shape.tokens, shape.buckets, shape.balance, shape.padding, shape.padding_fraction)
    train_tokens = max((t.option("micro_tokens") for t in graph.stages_of(StageKind.TRAIN)), default=0)
    tokens = stage.option("micro_tokens") or train_tokens  # unpacked: pad to the longest sequence
    return MicroBatching(tokens, (), "none", "longest", None)


def _channel(graph: StageGraph, stage: Stage) -> ChannelPlan:
    src = graph.producers(stage.name)[0].name
    dsts = tuple(c.name for c in graph.consumers(stage.name))
    fields = graph.flow(src, stage.name).fields
    c = stage.channel
    return ChannelPlan(stage.name, src, dsts, fields, c.capacity, c.samples_per_step, c.staleness)


def _dispatch(stage: Stage) -> DispatchPlan:
    d = stage.dispatch
    return DispatchPlan(stage.name, d.target, d.policy, d.group_affinity, d.instances)


def _weight_sync(graph: StageGraph, stage: Stage) -> WeightSyncPlan:
    src = graph.producers(stage.name)[0].name
    dst = graph.consumers(stage.name)[0].name
    sync, moved = stage.weight_sync, stage.weight_transfer
    if moved is None:  # not placed (build_plan refuses such graphs before it gets here)
        moved = WeightTransfer(0, "", "", False, "link")
    return WeightSyncPlan(stage.name, src, dst, sync.mode, sync.staleness, moved.bytes, moved.src_layout,
                          moved.dst_layout, moved.reshard, moved.transfer, sync.interrupt)


def plan_problems(plan: ExecutionPlan) -> list[str]:
    """Invariants of a plan: devices exist; no instance shares a device with another instance
    unless both belong to time-shared stages; channel capacity matches the staleness bound."""
    problems = []
    pools = {p.name: p.count for p in plan.pools}
    owners: dict[tuple[str, int], list[StagePlan]] = {}
    for stage in plan.stages:
        for inst in stage.instances:
            for d in inst.devices:
                if not 0 <= d < pools.get(stage.pool, 0):
                    problems.append(f"{stage.name}[{inst.index}] uses device {d} outside pool {stage.pool}")
                owners.setdefault((stage.pool, d), []).append(stage)
    for (pool, d), users in owners.items():
        names = [u.name for u in users]
        if len(set(names)) < len(names):
            problems.append(f"two instances of one stage share {pool}:{d}")
        elif len(users) > 1 and not all(u.placement == "time_shared" for u in users):
            problems.append(f"{pool}:{d} is given to {', '.join(names)}, which do not time-share")
    for c in plan.channels:
        if c.capacity != (c.staleness + 1) * c.samples_per_step:
            problems.append(f"channel {c.name}: capacity {c.capacity} != (staleness + 1) x samples per step")
    return problems
