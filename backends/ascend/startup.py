"""Start-up order on NPUs that several processes share (time-shared pools).

A colocated engine may need more than an equal share of its NPUs' memory (DeepSeek-V3's engine shard
alone is ~37 GB of a 64 GiB 910B). vllm-ascend's worker refuses to start unless the device's free
memory is at least total x gpu_memory_utilization (`vllm_ascend/worker/worker.py`), so the engine
starts first, alone on its NPUs, and goes to sleep (level 1: weights to host memory, KV cache
dropped, `vllm_ascend/device_allocator/camem.py`) before the trainers on the same NPUs build their
models. verl orders its hybrid engine the same way round in `verl/workers/megatron_workers.py`
(init_model: the actor offloads its parameters and optimizer before the rollout engine is built).
"""
from __future__ import annotations

from aspc.backends.ascend.engine_args import SLEEP_LEVEL

ENGINE_ROLE = "vllm-engine"


def startups(processes, roles: dict[str, str]) -> dict[str, dict]:
    """stage -> its start-up entry, for the stages whose NPUs a colocated engine also holds: engines
    start in phase 0 and sleep; the others start in phase 1, after those engines are asleep. Stages
    that share NPUs with no engine (a trainer and its reference model) need no order."""
    holders: dict[tuple[int, int], set[str]] = {}
    for p in processes:
        for d in p.devices:
            holders.setdefault((p.node, d), set()).add(p.stage)
    neighbours: dict[str, set[str]] = {}
    for stages in holders.values():
        for stage in stages:
            neighbours.setdefault(stage, set()).update(stages - {stage})
    out = {}
    for stage, others in neighbours.items():
        engines = sorted(s for s in others if roles[s] == ENGINE_ROLE)
        if roles[stage] == ENGINE_ROLE and others:
            out[stage] = {"phase": 0, "then": {"call": "sleep", "level": SLEEP_LEVEL}}
        elif engines:
            out[stage] = {"phase": 1, "after_asleep": engines}
    return out


def phase(startup: dict) -> int:
    return startup.get("phase", 0)
