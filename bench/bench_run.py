"""Real CPU training of pipelines/tiny_grpo.aspl under sync-naive, sync and asp, in one invocation,
with the simulator's prediction of the same plans beside the measurement: once with the cost
model calibrated by a micro-benchmark of the tiny model, once with the uncalibrated `cpu` entry.

    python bench/bench_run.py [--steps 40]
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

from aspc.backends.cpu.calibrate import calibrate
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.result import simulate
from aspc.accounting.measured import bubble_shares
from aspc.backends.cpu.executors import CpuExecutors
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.plan.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(f"steps: {args.steps} (after a 200-step warm start); machine: {platform.machine()}, "
          f"Python {platform.python_version()}\n")
    print("| schedule | wall (s) | step (s) | tokens/s | samples/s | final reward | greedy accuracy | "
          "useful | skewness | sorting | sync | idle | simulated step, calibrated (s) | uncalibrated (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    calibration = None
    for schedule in ("sync-naive", "sync", "asp"):
        plan = compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", schedule=schedule).plan()
        if calibration is None:
            calibration = calibrate(plan.model(plan.stages_of("train")[0].model).arch)
        runtime = LocalRuntime(plan, ROOT / "pipelines", RunOptions(steps=args.steps), CpuExecutors)
        runtime.build()
        result = runtime.run()
        tokens = sum(m["samples"] * m["response_len"] for m in result.metrics)
        samples = sum(m["samples"] for m in result.metrics)
        final = sum(m["reward"] for m in result.metrics[-10:]) / min(10, len(result.metrics))
        shares = bubble_shares(result.spans, result.wall_s)
        calibrated = simulate(plan, args.steps, RooflinePricing(plan, calibration)).step_time
        predicted = simulate(plan, args.steps, RooflinePricing(plan)).step_time
        print(f"| {schedule} | {result.wall_s:.1f} | {result.wall_s / args.steps:.3f} | {tokens / result.wall_s:.0f} | "
              f"{samples / result.wall_s:.1f} | {final:.3f} | {runtime.accuracy(256):.3f} | "
              + " | ".join(f"{100 * shares[c]:.0f}%" for c in ("useful", "skewness", "sorting", "sync", "idle"))
              + f" | {calibrated:.3f} ({calibrated / (result.wall_s / args.steps):.2f}x) | {predicted:.3f} |")


if __name__ == "__main__":
    main()
