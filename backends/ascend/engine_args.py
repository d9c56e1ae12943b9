"""vllm-ascend engine arguments: the `LLM(...)` keyword arguments of a generation or judge stage, how
its weights are refreshed, and the environment one engine process needs. Pure data; every name is
checked against the vLLM 0.23.0 and vllm-ascend 0.23.0 wheels in tests/test_ascend_conformance.py.

Followed (vLLM / vllm-ascend 0.23.0 wheels):
- `vllm/entrypoints/llm.py`: `LLM(data_parallel_size>1)` raises for single-process use; offline data
  parallelism is one process per rank with VLLM_DP_RANK / _RANK_LOCAL / _SIZE / _MASTER_IP /
  _MASTER_PORT (`vllm/config/parallel.py`, which also refuses it for dense models: their data-parallel
  ranks are independent engines).
- `vllm_ascend/device_allocator/camem.py`: the sleep-mode allocator asserts against
  PYTORCH_NPU_ALLOC_CONF=expandable_segments:True (vllm_ascend/platform.py sets it itself when sleep
  mode is off, so engines never get it from us).
- `vllm_ascend/worker/worker.py`: the start-up check wants free memory >= total x
  gpu_memory_utilization; `wake_up` refuses weight_nz_mode and `start_weight_update` refuses
  VLLM_ASCEND_ENABLE_NZ; weight updates need `weight_transfer_config` (backends "hccl" and
  "npu_ipc", registered in vllm_ascend/distributed/weight_transfer/__init__.py).
- `vllm_ascend/worker/worker.py` (determine_available_memory): the KV cache gets total x
  gpu_memory_utilization minus the weights and the profile run's peak; vLLM's
  `vllm/v1/core/kv_cache_utils.py` (check_enough_kv_cache_memory) refuses to start unless that holds
  one request of max_model_len. A time-shared engine's share is therefore at least its weight shard
  plus one max_model_len of KV plus a runtime margin (`engine_need`); it starts first on its NPUs and
  sleeps before the trainers there build (StageLaunch.startup), as verl's
  `verl/workers/megatron_workers.py` (init_model) orders a hybrid engine: the actor offloads before
  the rollout engine starts, so vLLM's free-memory check sees the device empty.
- verl's Ascend recipes export VLLM_ASCEND_ENABLE_NZ=0 for RL (FRACTAL_NZ breaks refreshed weights);
  the colocated refresh order (wake the weights, receive them, wake the KV cache) is verl's
  sleep/wake protocol for hybrid engines."""
from __future__ import annotations

from pathlib import Path

from aspc.backends.vllm.engine import engine_options
from aspc.backends.vllm.transfer import TRANSFER_CALLS
from aspc.controller.kinds import JUDGE_VERDICT_TOKENS
from aspc.costmodel.roofline import engine_memory, engine_model_len, engine_share, memory_share, parameters
from aspc.ir.facts import GIB
from aspc.plan.execution_plan import ExecutionPlan, ModelPlan, StagePlan
from aspc.platforms import NPU

JUDGE_RUBRIC_TOKENS = 1024  # room for the rubric around the prompt and the response
JUDGE_MEMORY = 0.9
# The NPU IPC buffer of a colocated refresh: vllm-ascend's DEFAULT_PACKED_BUFFER_SIZE_BYTES
# (vllm_ascend/distributed/weight_transfer/packed_tensor.py); the send widens it to the largest tensor
WEIGHT_BUCKET_BYTES = GIB
SLEEP_LEVEL = 1  # offload weights to host memory, drop the KV cache (vLLM's level 2 drops the weights too)
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# RL engines must not keep weights in the FRACTAL_NZ layout: refreshed weights arrive in ND.
RL_ADDITIONAL_CONFIG = {"weight_nz_mode": 0}
RL_ENV = {"VLLM_ASCEND_ENABLE_NZ": "0"}
# Colocated engines take their weights by NPU IPC: collective_rpc passes the handles' dtypes and
# storage classes to the engine's workers only pickled (vllm/v1/serial_utils.py)
IPC_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def placeholder_checkpoint(model: ModelPlan) -> str:
    return f"<no-checkpoint:{model.name}={model.preset}>"


def engine_model(model: ModelPlan, base_dir: Path | None) -> str:
    """vLLM's `model`: the checkpoint directory (hf("DIR") or `checkpoint = "DIR"`), absolute when the
    .aspl file's folder is known; without one, a placeholder the operator must replace with a Hugging
    Face checkpoint directory of that model (vLLM reads config.json and the tokenizer even with
    load_format="dummy"); the launch script says so in its header."""
    if not model.checkpoint:
        return placeholder_checkpoint(model)
    return str((base_dir / model.checkpoint).resolve()) if base_dir is not None else model.checkpoint


def engine_args(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None, sharers: int) -> dict:
    """LLM(...) keyword arguments of one data-parallel rank of a generation instance. `sharers`: the
    most processes that share one of its NPUs (time-shared pools); the engine asks for its share."""
    model = plan.model(stage.model)
    options = dict(stage.options)
    max_num_seqs = engine_max_num_seqs(options)
    max_model_len = engine_model_len(plan, stage)
    environments = plan.stages_of("environment")
    share = engine_memory(plan, stage, sharers)  # the share the simulator prices
    args = _common_args(model, stage, base_dir, max_num_seqs, share)
    args["max_model_len"] = max_model_len
    args |= engine_options(max_model_len)  # processed log-probs, whole-prompt prefills (aspc/backends/vllm)
    if environments:  # each turn is a new request whose prompt is the whole history (episodes.py)
        args["enable_prefix_caching"] = True
    args["enforce_eager"] = not options.get("graph_mode", True)
    if options.get("graph_mode", True):
        args["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes(max_num_seqs)}
    args["load_format"] = "dummy"  # the trainer's first weight refresh brings the weights
    args["weight_transfer_config"] = {"backend": transfer_backend(stage)}
    args["additional_config"] = dict(RL_ADDITIONAL_CONFIG)
    if plan.replays_routes():  # each output's routed_experts (vllm-ascend's model_runner_v1 captures them)
        args["enable_return_routed_experts"] = True
    return args


def judge_args(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None, sharers: int) -> dict:
    """An LLM judge: greedy, a short verdict, the rubric around the prompt and response in its
    context; frozen weights loaded from its checkpoint (never refreshed)."""
    model = plan.model(judge_source(stage).get("model"))
    data = plan.dataset(plan.stages_of("generate")[0].data)
    calls = judge_source(stage).get("concurrency")  # the calls in flight on one engine: its batch
    max_model_len = JUDGE_RUBRIC_TOKENS + data.max_prompt + data.max_response + JUDGE_VERDICT_TOKENS
    share = engine_share(plan, stage, model, max_model_len, memory_share(JUDGE_MEMORY, sharers))
    args = _common_args(model, stage, base_dir, calls, share)
    args |= {"max_model_len": max_model_len,
             "enforce_eager": False, "load_format": "auto" if model.checkpoint else "dummy",
             "compilation_config": {"cudagraph_capture_sizes": capture_sizes(calls)}}
    return args


def _common_args(model: ModelPlan, stage: StagePlan, base_dir: Path | None, max_num_seqs: int,
                 memory: float) -> dict:
    par = stage.parallel
    return {"model": engine_model(model, base_dir), "dtype": TORCH_DTYPES[model.dtype],
            "tensor_parallel_size": par.tp, "pipeline_parallel_size": par.pp,
            "enable_expert_parallel": par.ep > 1, "max_num_seqs": max_num_seqs,
            "gpu_memory_utilization": memory,
            "enable_sleep_mode": stage.placement == "time_shared", "seed": 0}


def judge_source(stage: StagePlan):
    return next(s for s in dict(stage.options)["sources"] if s.func == "judge")


def engine_max_num_seqs(options: dict) -> int:
    """vLLM's max_num_seqs (per data-parallel rank, as the stage's option counts it): the generate
    stage's option, else the cost model's default, so that the engine runs with what the simulator
    priced (its gpu_memory_utilization too: roofline.engine_memory)."""
    return options.get("max_num_seqs") or parameters()["generation"]["max_num_seqs_per_rank"]


def transfer_backend(stage: StagePlan) -> str:
    """npu_ipc between processes on the same NPUs (colocated), the platform's (hccl) across pools."""
    return "npu_ipc" if stage.placement == "time_shared" else NPU.weight_transfer


def weight_refresh(stage: StagePlan) -> dict:
    """The LLM calls of one weight refresh, in order. Colocated engines sleep while the learner
    runs and wake their weights first, then receive them (through an NPU IPC buffer of
    `bucket_bytes` per trainer rank), then wake the KV cache."""
    backend = transfer_backend(stage)
    if stage.placement != "time_shared":
        return {"backend": backend, "calls": TRANSFER_CALLS}
    return {"backend": backend, "sleep": {"call": "sleep", "level": SLEEP_LEVEL}, "bucket_bytes": WEIGHT_BUCKET_BYTES,
            "calls": [{"call": "wake_up", "tags": ["weights"]}, *TRANSFER_CALLS,
                      {"call": "wake_up", "tags": ["kv_cache"]}]}


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture as ACL graphs: 1, 2, 4, 8, then every 16 up to the cap."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return [s for s in sizes if s <= max_num_seqs]


def data_parallel_env(is_moe: bool, dp: int, rank: int, local_rank: int, master: str, port: int) -> dict:
    """VLLM_DP_* for one rank of a data-parallel MoE engine group (experts sharded over dp x tp);
    dense engines' data-parallel ranks are independent engines and get none."""
    if dp == 1 or not is_moe:
        return {}
    return {"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(local_rank), "VLLM_DP_SIZE": str(dp),
            "VLLM_DP_MASTER_IP": master, "VLLM_DP_MASTER_PORT": str(port)}
