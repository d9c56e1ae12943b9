"""The Ray runtime's overhead against the local runtime on the tiny pipeline (one invocation),
and the controller's cost per dispatch decision.

    python bench/bench_ray.py [--steps 20]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from aspc.controller import Controller, ControllerConfig
from aspc.controller.events import InstanceIdle, SampleFinished, Start
from aspc.backends.cpu.executors import CpuExecutors
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.drivers.ray.runtime import RayRuntime
from aspc.cli.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent


def timed_run(cls, steps: int) -> float:
    plan = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl").plan()
    runtime = cls(plan, ROOT / "pipelines", RunOptions(steps=steps), CpuExecutors)
    runtime.build()
    return runtime.run().wall_s


def dispatch_cost(instances: int = 8, samples: int = 4096) -> float:
    """Seconds per handled SampleFinished (each frees a slot and triggers a dispatch)."""
    config = ControllerConfig(1, samples // 8, 8, instances, 1, "queue_aware", True, 32, 0, (), "update", 1024)
    controller = Controller(config, lambda step, prompt: 100)
    pending = controller.handle(Start())
    for i in range(instances):
        pending += controller.handle(InstanceIdle(i, 64))
    requests = [(a.instance, r.sample) for a in pending if hasattr(a, "requests") for r in a.requests]
    start, handled = time.perf_counter(), 0
    while requests:
        instance, sample = requests.pop()
        actions = controller.handle(SampleFinished(sample, instance, 100))
        requests += [(a.instance, r.sample) for a in actions if hasattr(a, "requests") for r in a.requests]
        handled += 1
    return (time.perf_counter() - start) / handled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    local = timed_run(LocalRuntime, args.steps)
    on_ray = timed_run(RayRuntime, args.steps)
    print(f"| runtime | wall for {args.steps} steps (s) | ratio |\n|---|---|---|")
    print(f"| local | {local:.1f} | 1.00 |\n| ray | {on_ray:.1f} | {on_ray / local:.2f} |")
    print(f"\ncontroller: {dispatch_cost() * 1e6:.0f} µs per finished sample and the dispatch it triggers "
          "(8 instances, 4,096 samples, queue-aware)")


if __name__ == "__main__":
    main()
