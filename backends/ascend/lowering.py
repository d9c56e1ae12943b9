"""Execution plan -> launch plan: nodes, processes and ranks, per-process environment, HCCL
process groups, vllm-ascend engine arguments, megatron-core model configs, torchair compiler
options and the weight-sync transfers. Pure data; no Ascend software is imported here."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aspc.frontend.tool_schemas import SchemaError, tool_schemas
from aspc.ir.facts import DTYPE_BYTES, ModelArch
from aspc.plan.execution_plan import ExecutionPlan, ModelPlan, StagePlan, WeightSyncPlan
from aspc.backends.ascend.groups import process_groups
from aspc.controller.kinds import JUDGE_VERDICT_TOKENS
from aspc.costmodel.roofline import parameters
from aspc.backends.ascend.topology import Device, device, pool_offsets, visible_devices

LAUNCH_VERSION = 1
HCCL_ENV = {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1800", "HCCL_BUFFSIZE": "200"}
ALLOC_ENV = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
MEGATRON_KINDS = ("train", "reference", "critic")
BASE_PORT = 29500
JUDGE_RUBRIC_TOKENS = 1024  # room for the rubric around the prompt and the response


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


@dataclass(frozen=True)
class StageLaunch:
    stage: str
    kind: str
    role: str
    groups: dict  # axis -> lists of ranks
    config: dict  # megatron TransformerConfig fields, or vllm engine arguments
    model_args: dict  # GPTModel arguments (megatron) or {} (vllm)
    compiler: dict | None  # torchair CompilerConfig for forward-only executors
    micro_batching: dict | None


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


def lower(plan: ExecutionPlan, base_dir: Path | None = None) -> LaunchPlan:
    """base_dir: the .aspl file's folder, against which checkpoint directories are resolved (vLLM's
    `model`) and where python tool modules are looked up first (for the schemas of hermes tools
    that declare no parameters)."""
    offsets = pool_offsets(plan.pools)
    processes, stages = [], []
    for index, stage in enumerate(s for s in plan.stages if s.pool is not None):
        if stage.kind == "generate":
            processes += _engine_processes(plan, stage, offsets[stage.pool])
            stages.append(_engine_launch(plan, stage, base_dir))
        elif stage.kind in MEGATRON_KINDS:
            processes += _megatron_processes(stage, offsets[stage.pool], BASE_PORT + index)
            stages.append(_megatron_launch(plan, stage))
        elif _source_models(stage, "judge"):
            processes += _engine_processes(plan, stage, offsets[stage.pool])
            stages.append(_judge_launch(plan, stage, base_dir))
        elif _source_models(stage, "model"):
            processes += _megatron_processes(stage, offsets[stage.pool], BASE_PORT + index)
            stages.append(_reward_model_launch(plan, stage))
    stages += [_tool_runner_launch(stage, base_dir) for stage in plan.stages_of("environment")]
    transfers = [t for sync in plan.weight_syncs for t in _transfers(plan, sync)]
    nodes = max((p.node for p in processes), default=-1) + 1
    return LaunchPlan(plan.pipeline, plan.schedule, nodes, tuple(processes), tuple(stages), tuple(transfers))


# ---- generation: vllm-ascend engines ----
def _engine_processes(plan: ExecutionPlan, stage: StagePlan, offset: int) -> list[Process]:
    """One engine process per data-parallel rank of each instance, holding tp x pp NPUs."""
    par = stage.parallel
    per_rank = par.tp * par.pp * par.cp
    out = []
    for inst in stage.instances:
        for dp in range(par.dp):
            first = inst.first_device + dp * per_rank
            devs = [device(offset, first + k) for k in range(per_rank)]
            node = _one_node(devs, stage.name)
            env = {**HCCL_ENV, **ALLOC_ENV, "ASCEND_RT_VISIBLE_DEVICES": visible_devices(devs)}
            name = f"{stage.name}.{inst.index}.dp{dp}"
            command = ("python", "-m", "aspc.backends.ascend.executors", "generate", "--plan", "launch.json",
                       "--stage", stage.name, "--instance", str(inst.index), "--dp-rank", str(dp))
            out.append(Process(name, stage.name, "vllm-engine", node, tuple(d.local for d in devs), dp, par.dp,
                               stage.placement == "time_shared", env, command))
    return out


def _one_node(devs: list[Device], stage: str) -> int:
    nodes = {d.node for d in devs}
    if len(nodes) != 1:
        raise ValueError(f"stage '{stage}': a tensor-parallel group must stay on one node, "
                         f"but it spans nodes {sorted(nodes)}")
    return nodes.pop()


def engine_model(model: ModelPlan, base_dir: Path | None) -> str:
    """vLLM's `model`: the checkpoint directory (hf("DIR") or `checkpoint = "DIR"`), absolute when the
    .aspl file's folder is known; without one, a marker that no directory exists (vLLM needs a
    config.json directory even for load_format="dummy")."""
    if not model.checkpoint:
        return f"<no-checkpoint:{model.name}={model.preset}>"
    return str((base_dir / model.checkpoint).resolve()) if base_dir is not None else model.checkpoint


def _engine_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None) -> StageLaunch:
    model = plan.model(stage.model)
    data = plan.dataset(stage.data)
    options = dict(stage.options)
    par = stage.parallel
    max_num_seqs, memory = _engine_limits(options)
    args = {
        "model": engine_model(model, base_dir), "dtype": _torch_dtype(model.dtype), "tensor_parallel_size": par.tp,
        "pipeline_parallel_size": par.pp, "data_parallel_size": par.dp,
        "enable_expert_parallel": par.ep > 1, "max_num_seqs": max_num_seqs,
        "max_model_len": data.max_prompt + options["max_tokens"], "gpu_memory_utilization": memory,
        "enforce_eager": not options.get("graph_mode", True), "enable_sleep_mode": stage.placement == "time_shared",
        "load_format": "dummy", "seed": 0,
    }
    if options.get("graph_mode", True):
        args["compilation_config"] = {"cudagraph_capture_sizes": _capture_sizes(max_num_seqs)}
    refresh = "wake_up+reload_weights" if stage.placement == "time_shared" else "hccl_weight_transfer"
    return StageLaunch(stage.name, stage.kind, "vllm-engine", {}, args, {}, None,
                       {"weight_refresh": refresh, "sampling": {"temperature": options["temperature"],
                                                                "top_p": options["top_p"],
                                                                "max_tokens": options["max_tokens"]}})


def _engine_limits(options: dict) -> tuple[int, float]:
    """vLLM's max_num_seqs (per data-parallel rank, as the stage's option counts it) and
    gpu_memory_utilization: the generate stage's options, else the cost model's defaults, so that
    the engine runs with what the simulator priced."""
    defaults = parameters()
    return (options.get("max_num_seqs") or defaults["generation"]["max_num_seqs_per_rank"],
            options.get("gpu_memory_utilization") or defaults["efficiency"]["memory"])


# ---- reward sources on devices: a judge engine, a reward model ----
def _source_models(stage: StagePlan, func: str) -> list[str]:
    """The models of a reward stage's `func(...)` sources ("model" or "judge")."""
    if stage.kind != "reward":
        return []
    return [source.get("model") for source in dict(stage.options).get("sources", ()) if source.func == func]


def _judge_launch(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None) -> StageLaunch:
    """An LLM judge is a vllm-ascend engine like generation: greedy, a short verdict, the rubric
    around the prompt and response in its context; its weights are frozen (no refresh)."""
    model = plan.model(_source_models(stage, "judge")[0])
    gen = plan.stages_of("generate")[0]
    data = plan.dataset(gen.data)
    par = stage.parallel
    context = JUDGE_RUBRIC_TOKENS + data.max_prompt + data.max_response + JUDGE_VERDICT_TOKENS
    source = next(s for s in dict(stage.options)["sources"] if s.func == "judge")
    calls = source.get("concurrency")  # the calls in flight on one engine: its batch
    args = {
        "model": engine_model(model, base_dir), "dtype": _torch_dtype(model.dtype), "tensor_parallel_size": par.tp,
        "pipeline_parallel_size": par.pp, "data_parallel_size": par.dp, "enable_expert_parallel": par.ep > 1,
        "max_num_seqs": calls, "max_model_len": context, "gpu_memory_utilization": 0.9, "enforce_eager": False,
        "enable_sleep_mode": stage.placement == "time_shared", "seed": 0,
        "load_format": "auto" if model.checkpoint else "dummy",  # frozen: its weights come from the directory
        "compilation_config": {"cudagraph_capture_sizes": _capture_sizes(calls)},
    }
    sampling = {"temperature": 0.0, "max_tokens": JUDGE_VERDICT_TOKENS, "logprobs": 5}
    policy = {"read": source.get("read"), "timeout_s": source.get("timeout"), "fallback_reward": source.get("fallback")}
    return StageLaunch(stage.name, stage.kind, "vllm-engine", {}, args, {}, None,
                       {"weight_refresh": "none (frozen judge)", "sampling": sampling, "calls": policy})


def _tool_runner_launch(stage: StagePlan, base_dir: Path | None) -> StageLaunch:
    """An environment's tools run on the hosts' CPUs, not on NPUs: the CPU backend's ToolRunner
    (backends/cpu/tool_runner.py: a fork server, one confined child per call), `tool_workers` at
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


def _reward_model_launch(plan: ExecutionPlan, stage: StagePlan) -> StageLaunch:
    """A reward model is a megatron-core forward-only model with a scalar head read at each
    sequence's last token (as MindSpeed-RL's RewardWorker and verl's MegatronRewardModel run it),
    not a vLLM pooling runner: it shares the trainer's model code, parallel layouts and packing,
    and needs no second inference stack on the NPUs."""
    model = plan.model(_source_models(stage, "model")[0])
    config = transformer_config(model.arch, model.dtype, stage.parallel, False)
    model_args = {"vocab_size": model.arch.vocab, "max_sequence_length": model.arch.max_seq,
                  "position_embedding_type": "rope", "rotary_base": _rotary_base(model),
                  "share_embeddings_and_output_weights": False, "post_process": False}  # hidden states out
    compiler = {"mode": "max-autotune", "experimental_config": {"frozen_parameter": True,
                                                                "tiling_schedule_optimize": True},
                "dynamic": True, "static_shapes": []}
    scoring = {"head": "linear(hidden, 1) on the last token of prompt + response", "packing": "none"}
    return StageLaunch(stage.name, stage.kind, "megatron-forward", process_groups(stage.parallel), config,
                       model_args, compiler, {"scoring": scoring})


def _capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture as ACL graphs: 1, 2, 4, 8, then every 16 up to the cap."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return [s for s in sizes if s <= max_num_seqs]


# ---- train, reference, critic, reward models: megatron-core ----
def _megatron_processes(stage: StagePlan, offset: int, port: int) -> list[Process]:
    """One megatron job per instance (a train stage has one; a reward model may have several)."""
    world = stage.parallel.devices
    out = []
    for inst in stage.instances:
        devs = [device(offset, inst.first_device + r) for r in range(world)]
        master = f"node{devs[0].node}"
        job_port = port + 100 * inst.index
        prefix = stage.name if len(stage.instances) == 1 else f"{stage.name}.{inst.index}"
        for rank, d in enumerate(devs):
            env = {**HCCL_ENV, **ALLOC_ENV, "ASCEND_RT_VISIBLE_DEVICES": str(d.local), "RANK": str(rank),
                   "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": master, "MASTER_PORT": str(job_port)}
            role = "megatron-train" if stage.kind in ("train", "critic") else "megatron-forward"
            command = ("python", "-m", "aspc.backends.ascend.executors", stage.kind, "--plan", "launch.json",
                       "--stage", stage.name, "--rank", str(rank))
            if len(stage.instances) > 1:
                command += ("--instance", str(inst.index))
            out.append(Process(f"{prefix}.rank{rank}", stage.name, role, d.node, (d.local,), rank, world,
                               stage.placement == "time_shared", env, command))
    return out


def _megatron_launch(plan: ExecutionPlan, stage: StagePlan) -> StageLaunch:
    model = plan.model(stage.model)
    options = dict(stage.options)
    recompute = bool(options.get("recompute", False))
    config = transformer_config(model.arch, model.dtype, stage.parallel, recompute)
    model_args = {"vocab_size": model.arch.vocab, "max_sequence_length": model.arch.max_seq,
                  "position_embedding_type": "rope", "rotary_base": _rotary_base(model),
                  "share_embeddings_and_output_weights": model.arch.tied}
    compiler = None
    mb = stage.micro_batching
    if stage.kind == "reference":
        compiler = {"mode": "max-autotune", "experimental_config": {"frozen_parameter": True,
                                                                    "tiling_schedule_optimize": True},
                    "dynamic": False, "static_shapes": list(mb.buckets) or [mb.tokens]}
    micro = {"tokens": mb.tokens, "buckets": list(mb.buckets), "padding": mb.padding, "balance": mb.balance}
    return StageLaunch(stage.name, stage.kind, "megatron-train" if stage.kind != "reference" else "megatron-forward",
                       process_groups(stage.parallel), config, model_args, compiler, micro)


def transformer_config(arch: ModelArch, dtype: str, par, recompute: bool) -> dict[str, Any]:
    """Fields of megatron-core's TransformerConfig (MLATransformerConfig for MLA models)."""
    config = {
        "num_layers": arch.layers, "hidden_size": arch.hidden, "num_attention_heads": arch.heads,
        "num_query_groups": arch.kv_heads, "kv_channels": arch.head_dim, "ffn_hidden_size": arch.ffn,
        "normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias, "bf16": dtype == "bf16", "fp16": dtype == "fp16",
        "tensor_model_parallel_size": par.tp, "pipeline_model_parallel_size": par.pp,
        "context_parallel_size": par.cp, "expert_model_parallel_size": par.ep,
        "sequence_parallel": par.tp > 1, "params_dtype": _torch_dtype(dtype),
    }
    if par.pp > 1:
        config["pipeline_dtype"] = _torch_dtype(dtype)
    if recompute:
        config |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if arch.experts:
        config |= {"num_moe_experts": arch.experts, "moe_router_topk": arch.top_k,
                   "moe_ffn_hidden_size": arch.expert_ffn, "moe_grouped_gemm": True,
                   "moe_token_dispatcher_type": "alltoall"}
        if arch.shared_experts:
            config["moe_shared_expert_intermediate_size"] = arch.shared_experts * arch.expert_ffn
        if arch.dense_layers:
            config["moe_layer_freq"] = [0] * arch.dense_layers + [1] * (arch.layers - arch.dense_layers)
    if arch.attention == "mla":
        config |= {"multi_latent_attention": True, "q_lora_rank": arch.q_lora_rank,
                   "kv_lora_rank": arch.kv_lora_rank, "qk_head_dim": arch.head_dim - arch.qk_rope_dim,
                   "qk_pos_emb_head_dim": arch.qk_rope_dim, "v_head_dim": arch.v_head_dim}
        config.pop("kv_channels")
    return config


def _torch_dtype(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]


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


def _rotary_base(model: ModelPlan) -> float:
    """RoPE's base: config.json's for hf(...) models; the presets' (Qwen) and custom models'."""
    if model.preset == "hf":
        return model.arch.rope_theta
    return 1_000_000 if model.preset != "custom" else 10_000
