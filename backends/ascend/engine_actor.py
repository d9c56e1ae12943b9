"""A generation instance on NPUs is the engine class every platform shares
(aspc/backends/vllm/engine.py), which vllm-ascend serves as vLLM's platform plugin; its weight
refresh goes around the trainer's HCCL broadcast (separate pools) or the trainer ranks' NPU IPC
send (colocated pools, npu_ipc). Agentic episodes run on its subclass EpisodeEngine
(aspc/backends/vllm/episodes.py).
vllm-ascend 0.23.0's NPU worker (vllm_ascend/worker/worker.py) needs the engine built with
`weight_transfer_config` and VLLM_ASCEND_ENABLE_NZ=0; `reload_weights` is not implemented there.
This module names what the Ascend backend's modules use of it."""
from __future__ import annotations

from aspc.backends.vllm.engine import (Finished, PublishedWeights, VllmEngine, engine_environment,  # noqa: F401
                                       refresh_call_name, vllm_api)
from aspc.platforms import NPU

# What places one engine process on an NPU host (its NPUs, its HCCL ports, its data-parallel rank)
PLACEMENT_ENV = NPU.placement_env

