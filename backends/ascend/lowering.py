"""Execution plan -> launch plan: nodes, processes and ranks, per-process environment, HCCL
process groups, vllm-ascend engine arguments, megatron-core model configs, torchair compiler
options and the weight-sync transfers. Pure data; no Ascend software is imported here. The
engine arguments live in engine_args.py, the megatron ones in megatron_args.py, each with the
sources they follow."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aspc.backends.ascend import engine_args as vllm
from aspc.backends.ascend import megatron_args as megatron
from aspc.backends.ascend.checkpoint_settings import checkpoint_settings
from aspc.backends.ascend.groups import process_groups, rank_coords
from aspc.backends.ascend.process_env import ALLOC_ENV, HCCL_ENV, node_address, port_ranges, socket_env
from aspc.backends.ascend.startup import startups
from aspc.backends.ascend.topology import Device, device, pool_offsets, visible_devices
from aspc.frontend.tool_schemas import SchemaError, tool_schemas
from aspc.controller.kinds import rule_for
from aspc.ir.facts import DTYPE_BYTES, ModelArch
from aspc.ir.kinds import kinds_where
from aspc.plan.execution_plan import ExecutionPlan, StagePlan, WeightSyncPlan
from aspc.platforms import NPU

LAUNCH_VERSION = 2
# The kinds megatron-core runs (the kind table's Ascend rules: aspc/ir/kinds.py). Reference and critic
# are built in the train stage's processes, on their NPUs and megatron groups (reference_model.py: the
# frozen reference; critic.py: the critic, refused elsewhere): no processes of their own to start.
MEGATRON_KINDS = tuple(k.value for k in kinds_where(lambda r: r.ascend is not None and r.ascend.runner == "megatron"))
BASE_PORT = 29500
DP_BASE_PORT = 27000  # vLLM data-parallel rendezvous: 1000 a stage, 16 an instance


@dataclass(frozen=True)
class Process:
    name: str
    stage: str
    role: str  # "vllm-engine" | "megatron-train" | "megatron-forward" (reference, reward model)
    node: int
    devices: tuple[int, ...]  # local NPU indices on its node
    rank: int | None  # rank in its stage's job (megatron), or the engine's data-parallel rank
    world_size: int
    time_shared: bool
    env: dict
    command: tuple[str, ...]
    model_args: dict = field(default_factory=dict)  # this rank's GPTModel arguments (pre_process, post_process)


@dataclass(frozen=True)
class StageLaunch:
    stage: str
    kind: str
    role: str
    groups: dict  # axis -> lists of ranks
    config: dict  # megatron TransformerConfig fields, or vllm engine arguments (LLM keyword arguments)
    model_args: dict  # GPTModel arguments shared by every rank (megatron) or {} (vllm)
    compiler: dict | None  # torchair CompilerConfig for forward-only executors
    micro_batching: dict | None  # megatron: packing; engines: sampling and the weight refresh
    # megatron: config_class, layer_spec {function, arguments}, mindspeed_argv, checkpoint
    builders: dict = field(default_factory=dict)
    # NPUs shared with other stages: start-up phase, and what follows it (startup.py)
    startup: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Transfer:
    sync: str
    src_stage: str
    src_rank: int
    dst_stage: str
    dst_instance: int
    dst_tp_rank: int
    bytes: int


@dataclass(frozen=True)
class LaunchPlan:
    pipeline: str
    schedule: str
    nodes: int
    processes: tuple[Process, ...]
    stages: tuple[StageLaunch, ...]
    transfers: tuple[Transfer, ...]

    def to_json(self) -> str:
        doc = {"format": "aspc.launch_plan", "version": LAUNCH_VERSION, **dataclasses.asdict(self)}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    def placeholders(self) -> list[str]:
        """Checkpoint directories the operator must supply (models without one)."""
        found = {s.config.get("model") for s in self.stages} | {s.builders.get("checkpoint") for s in self.stages}
        return sorted(p for p in found if isinstance(p, str) and p.startswith("<no-checkpoint:"))


def lower(plan: ExecutionPlan, base_dir: Path | None = None, node_addresses: tuple[str, ...] | None = None,
          socket_ifname: str | None = None) -> LaunchPlan:
    """base_dir: the .aspl file's folder, against which checkpoint directories are resolved (vLLM's
    `model`) and where python tool modules are looked up first (for the schemas of hermes tools
    that declare no parameters). node_addresses: one per node, node0 first (ASPC_NODES); without
    them, rendezvous addresses are references the launch script resolves. socket_ifname: the network
    interface of HCCL's and gloo's sockets (ASPC_SOCKET_IFNAME); without it, a reference each node
    resolves (process_env.socket_env)."""
    offsets = pool_offsets(plan.pools)
    placed, processes = [], []
    for index, stage in enumerate(s for s in plan.stages if s.pool is not None):
        role = _role(stage)
        if role == "vllm-engine":
            port = DP_BASE_PORT + 1000 * index
            processes += _engine_processes(plan, stage, offsets[stage.pool], port, node_addresses)
        elif role is not None and not in_trainer(plan, stage):
            processes += _megatron_processes(stage, offsets[stage.pool], BASE_PORT + index, node_addresses)
        if role is not None:
            placed.append(stage)
    sockets = socket_env(socket_ifname)
    processes = [dataclasses.replace(p, env={**p.env, **sockets}) for p in _with_port_ranges(processes)]
    users = Counter((p.node, d) for p in processes for d in p.devices)
    stages = [_stage_launch(plan, stage, base_dir, _sharers(stage, processes, users)) for stage in placed]
    order = startups(processes, {s.stage: s.role for s in stages})
    stages = [dataclasses.replace(s, startup=order.get(s.stage, {})) for s in stages]
    stages += [_tool_runner_launch(stage, base_dir) for stage in plan.stages_of("environment")]
    transfers = [t for sync in plan.weight_syncs for t in _transfers(plan, sync)]
    nodes = max((p.node for p in processes), default=-1) + 1
    return LaunchPlan(plan.pipeline, plan.schedule, nodes, tuple(processes), tuple(stages), tuple(transfers))


def in_trainer(plan: ExecutionPlan, stage: StagePlan) -> bool:
    """The stage runs in the train stage's processes (its launch stage has no processes)."""
    ascend = rule_for(stage).ascend
    return ascend is not None and ascend.in_trainer and bool(plan.stages_of("train"))


def _role(stage: StagePlan) -> str | None:
    """The Ascend runner from the kind table: "vllm-engine" (generation, judges) | "megatron" (train,
    reference, critic, reward models); None: on the host."""
    ascend = rule_for(stage).ascend
    return ascend.runner if ascend is not None else None


def _stage_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None, sharers: int) -> StageLaunch:
    if stage.kind == "generate":
        return _engine_launch(plan, stage, base_dir, sharers)
    if stage.kind in MEGATRON_KINDS:
        return _megatron_launch(plan, stage, base_dir)
    if _source_models(stage, "judge"):
        return _judge_launch(plan, stage, base_dir, sharers)
    return _reward_model_launch(plan, stage, base_dir)


def _sharers(stage: StagePlan, processes: list[Process], users: Counter) -> int:
    """The most processes that hold one NPU of this stage's (time-shared pools: several)."""
    return max((users[(p.node, d)] for p in processes if p.stage == stage.name for d in p.devices), default=1)


def _with_port_ranges(processes: list[Process]) -> list[Process]:
    """Processes on NPUs that other processes use too get HCCL socket port ranges of their own."""
    users = Counter((p.node, d) for p in processes for d in p.devices)
    slots: Counter = Counter()
    out = []
    for p in processes:
        if any(users[(p.node, d)] > 1 for d in p.devices):
            p = dataclasses.replace(p, env={**p.env, **port_ranges(slots[p.node])})
            slots[p.node] += 1
        out.append(p)
    return out


# ---- generation and judges: vllm-ascend engines ----
def _engine_processes(plan: ExecutionPlan, stage: StagePlan, offset: int, port: int,
                      addresses: tuple[str, ...] | None) -> list[Process]:
    """One engine process per data-parallel rank of each instance, holding tp x pp NPUs of one node.
    A MoE instance's data-parallel ranks form one vLLM data-parallel group (VLLM_DP_*)."""
    par = stage.parallel
    per_rank = par.tp * par.pp * par.cp
    is_moe = bool(_engine_arch(plan, stage).experts)
    refresh_env = vllm.RL_ENV if stage.kind == "generate" else {}
    if stage.kind == "generate" and stage.placement == "time_shared":
        refresh_env = {**refresh_env, **vllm.IPC_ENV}
    out = []
    for inst in stage.instances:
        ranks = [[device(offset, inst.first_device + dp * per_rank + k) for k in range(per_rank)]
                 for dp in range(par.dp)]
        nodes = [_one_node(devs, stage.name) for devs in ranks]
        master = node_address(nodes[0], addresses)
        for dp, devs in enumerate(ranks):
            env = {**HCCL_ENV, **refresh_env, NPU.visible_devices: visible_devices(devs),
                   **vllm.data_parallel_env(is_moe, par.dp, dp, nodes[:dp].count(nodes[dp]), master,
                                            port + 16 * inst.index)}
            command = ("python", "-m", "aspc.backends.ascend.executors", "generate", "--plan", "launch.json",
                       "--stage", stage.name, "--instance", str(inst.index), "--dp-rank", str(dp))
            out.append(Process(f"{stage.name}.{inst.index}.dp{dp}", stage.name, "vllm-engine", nodes[dp],
                               tuple(d.local for d in devs), dp, par.dp, stage.placement == "time_shared", env,
                               command))
    return out


def _engine_arch(plan: ExecutionPlan, stage: StagePlan) -> ModelArch:
    name = stage.model if stage.kind == "generate" else vllm.judge_source(stage).get("model")
    return plan.model(name).arch


def _one_node(devs: list[Device], stage: str) -> int:
    nodes = {d.node for d in devs}
    if len(nodes) != 1:
        raise ValueError(f"stage '{stage}': a tensor-parallel group must stay on one node, "
                         f"but it spans nodes {sorted(nodes)}")
    return nodes.pop()


def _engine_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None, sharers: int) -> StageLaunch:
    options = dict(stage.options)
    sampling = {"temperature": options["temperature"], "top_p": options["top_p"], "max_tokens": options["max_tokens"]}
    return StageLaunch(stage.name, stage.kind, "vllm-engine", {}, vllm.engine_args(plan, stage, base_dir, sharers),
                       {}, None, {"weight_refresh": vllm.weight_refresh(stage), "sampling": sampling})


def _judge_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None, sharers: int) -> StageLaunch:
    """An LLM judge is a vllm-ascend engine like generation: greedy, a short verdict, top-5
    log-probabilities; its weights are frozen (no refresh)."""
    source = vllm.judge_source(stage)
    sampling = {"temperature": 0.0, "max_tokens": vllm.JUDGE_VERDICT_TOKENS, "logprobs": 5}
    policy = {"read": source.get("read"), "timeout_s": source.get("timeout"), "fallback_reward": source.get("fallback")}
    return StageLaunch(stage.name, stage.kind, "vllm-engine", {}, vllm.judge_args(plan, stage, base_dir, sharers),
                       {}, None, {"weight_refresh": None, "sampling": sampling, "calls": policy})


# ---- reward sources on devices: a judge engine, a reward model ----
def _source_models(stage: StagePlan, func: str) -> list[str]:
    """The models of a reward stage's `func(...)` sources ("model" or "judge")."""
    if stage.kind != "reward":
        return []
    return [source.get("model") for source in dict(stage.options).get("sources", ()) if source.func == func]


def _tool_runner_launch(stage: StagePlan, base_dir: Path | None) -> StageLaunch:
    """An environment's tools run on the hosts' CPUs, not on NPUs: the host's ToolRunner
    (aspc/rl/tool_runner.py: a fork server, one confined child per call), `tool_workers` at
    once; the episodes themselves run inside the vllm-ascend engines' continuous batches.
    `tools_schema` is the OpenAI-style function list that the chat template takes as `tools=` for
    format = hermes (aspc/frontend/tool_schemas.py); None for compact, which has no template."""
    options = dict(stage.options)
    tools = [{"name": t.get("name"), "python": t.get("python"), "command": t.get("command"),
              "timeout_s": t.get("timeout"), "description": t.get("description"), "parameters": t.get("parameters")}
             for t in options["tools"]]
    config = {"tools": tools, "workers": options["tool_workers"], "format": options["format"],
              "max_turns": options["max_turns"], "max_invalid": options["max_invalid"],
              "max_tool_tokens": options["max_tool_tokens"], "tools_schema": _tools_schema(options, base_dir)}
    return StageLaunch(stage.name, stage.kind, "tool-runner (host CPU)", {}, config, {}, None, None)


def _tools_schema(options: dict, base_dir: Path | None) -> list[dict] | None:
    if options["format"] != "hermes":
        return None
    try:
        return tool_schemas(options["tools"], base_dir)
    except SchemaError as error:  # the CLI shows a ValueError as "cannot lower to Ascend: ..."
        raise ValueError(f"{error.message} ({error.hint})" if error.hint else error.message) from None


def _reward_model_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None) -> StageLaunch:
    """A reward model is a megatron-core forward-only model with a scalar head read at each
    sequence's last token (as MindSpeed-RL's RewardWorker and verl's MegatronRewardModel run it),
    not a vLLM pooling runner: it shares the trainer's model code, parallel layouts and packing,
    and needs no second inference stack on the NPUs. Hidden states out: no output layer."""
    model = plan.model(_source_models(stage, "model")[0])
    compiler = {"mode": "max-autotune", "experimental_config": {"frozen_parameter": True,
                                                                "tiling_schedule_optimize": True},
                "dynamic": True, "static_shapes": []}
    scoring = {"head": "linear(hidden, 1) on the last token of prompt + response", "packing": "none"}
    config, model_args, builders = _megatron_model(model, stage, base_dir, False, model.arch.max_seq)
    return StageLaunch(stage.name, stage.kind, "megatron-forward", process_groups(stage.parallel), config,
                       model_args, compiler, {"scoring": scoring}, builders)  # each rank: post_process False


# ---- train, reference, critic, reward models: megatron-core ----
def _megatron_processes(stage: StagePlan, offset: int, port: int,
                        addresses: tuple[str, ...] | None) -> list[Process]:
    """One megatron job per instance (a train stage has one; a reward model may have several)."""
    par = stage.parallel
    world = par.devices
    coords = rank_coords(par)
    post_process = not _source_models(stage, "model")  # a reward model ends in hidden states
    role = rule_for(stage).ascend.megatron_role
    out = []
    for inst in stage.instances:
        devs = [device(offset, inst.first_device + r) for r in range(world)]
        master = node_address(devs[0].node, addresses)
        prefix = stage.name if len(stage.instances) == 1 else f"{stage.name}.{inst.index}"
        for rank, d in enumerate(devs):
            env = {**HCCL_ENV, **ALLOC_ENV, NPU.visible_devices: str(d.local), "RANK": str(rank),
                   "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": master,
                   "MASTER_PORT": str(port + 100 * inst.index)}
            command = ("python", "-m", "aspc.backends.ascend.executors", stage.kind, "--plan", "launch.json",
                       "--stage", stage.name, "--rank", str(rank))
            if len(stage.instances) > 1:
                command += ("--instance", str(inst.index))
            out.append(Process(f"{prefix}.rank{rank}", stage.name, role, d.node, (d.local,), rank, world,
                               stage.placement == "time_shared", env, command,
                               megatron.rank_model_args(coords[rank]["pp"], par.pp, post_process)))
    return out


def _megatron_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None) -> StageLaunch:
    model = plan.model(stage.model)
    mb = stage.micro_batching
    config, model_args, builders = _megatron_model(model, stage, base_dir, bool(dict(stage.options).get("recompute")),
                                                   mb.tokens)
    compiler = None
    if stage.kind == "reference":
        compiler = {"mode": "max-autotune", "experimental_config": {"frozen_parameter": True,
                                                                    "tiling_schedule_optimize": True},
                    "dynamic": False, "static_shapes": list(mb.buckets) or [mb.tokens]}
    micro = {"tokens": mb.tokens, "buckets": list(mb.buckets), "padding": mb.padding, "balance": mb.balance}
    return StageLaunch(stage.name, stage.kind, rule_for(stage).ascend.megatron_role,
                       process_groups(stage.parallel), config, model_args, compiler, micro, builders)


def _megatron_model(model, stage: StagePlan, base_dir: Path | None, recompute: bool, seq_length: int):
    """TransformerConfig fields, GPTModel arguments and how to build them, for one stage's model."""
    settings = checkpoint_settings(model)
    arch, par = model.arch, stage.parallel
    config = megatron.transformer_config(arch, model.dtype, par, recompute, settings)
    builders = {"config_class": megatron.config_class(arch), "layer_spec": megatron.layer_spec(arch, settings),
                "mindspeed_argv": megatron.mindspeed_argv(par, seq_length),
                "checkpoint": vllm.engine_model(model, base_dir)}
    if stage.kind in ("train", "critic"):  # megatron's distributed optimizer, as the memory check priced it
        builders["distributed_optimizer"] = bool(dict(stage.options).get("distributed_optimizer", True))
    if stage.replays_routes():
        config["moe_enable_routing_replay"] = True  # the policy's routers replay the engine's experts (R3)
    # a critic's output layer is its value head (critic.py), never the embedding's transpose: verl builds
    # value models untied (verl/models/mcore/model_initializer.py, LinearForLastLayer)
    return config, megatron.model_args(arch, settings, arch.tied and stage.kind != "critic"), builders


# ---- weight sync ----
def _transfers(plan: ExecutionPlan, sync: WeightSyncPlan) -> list[Transfer]:
    """Train layout -> generate layout: each source shard (pp stage, tp rank; data-parallel
    replica 0) sends every destination tp rank the overlap of their parameter slices."""
    src, dst = plan.stage(sync.src), plan.stage(sync.dst)
    sp, dp_ = src.parallel, dst.parallel
    per_stage = sync.bytes / sp.pp
    out = []
    for inst in dst.instances:
        for pp in range(sp.pp):
            for j in range(sp.tp):
                for i in range(dp_.tp):
                    overlap = max(0.0, min((j + 1) / sp.tp, (i + 1) / dp_.tp) - max(j / sp.tp, i / dp_.tp))
                    if overlap > 0:
                        rank = pp * (sp.dp * sp.cp * sp.tp) + j  # dp 0, cp 0
                        out.append(Transfer(sync.name, src.name, rank, dst.name, inst.index, i,
                                            round(per_stage * overlap)))
    return out


def weight_bytes(arch: ModelArch, dtype: str) -> int:
    return arch.total_params() * DTYPE_BYTES[dtype]
