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


PLATFORMS = {
    "cpu": Platform("cpu", None, "gloo", graph_mode=False, sleep=False),
    "npu": Platform("npu", "ASCEND_RT_VISIBLE_DEVICES", "hccl", graph_mode=True, sleep=True),
    "cuda": Platform("cuda", "CUDA_VISIBLE_DEVICES", "nccl", graph_mode=True, sleep=True),  # no backend yet
}
NPU = PLATFORMS["npu"]
