"""Real CPU training of the bundled CPU pipelines under sync-naive, sync and asp in one invocation,
with the simulator's prediction of each plan (the cost model calibrated by a micro-benchmark of
the tiny model) beside the measurement. Prints a Markdown table (the one in bench/RESULTS.md) and
with --json writes

    {"machine": {...}, "steps": N, "workers": ..., "pipelines": {NAME: {"sync-naive" | "sync" | "asp":
        {"step_s": ..., "tokens_per_s": ..., "simulated_step_s": ..., "bubbles": {...}}}}}

    python bench/bench_run.py [--steps 20] [--json OUT] [--pipelines tiny_grpo tiny_ppo ...]
                              [--workers processes|threads]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from aspc.accounting.measured import bubble_shares
from aspc.backends.cpu.calibrate import calibrate
from aspc.backends.cpu.executors import CpuExecutors
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.drivers.sim.result import simulate
from aspc.plan.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ("tiny_grpo", "tiny_grpo_split", "tiny_ppo", "tiny_rlhf", "tiny_rlaif", "tiny_agentic")
SCHEDULES = ("sync-naive", "sync", "asp")
WARM_START = {"tiny_agentic": 800}  # it needs the call format shown (docs/runtime.md); others: 200
SHOWN = ("useful", "skewness", "sorting", "sync", "idle", "tool_wait")


def measure(name: str, schedule: str, steps: int, workers: str, calibration) -> tuple[dict, object]:
    path = ROOT / "pipelines" / f"{name}.aspl"
    plan = compile_with_passes(path, schedule=schedule).plan()
    calibration = calibration or calibrate(plan.model(plan.stages_of("train")[0].model).arch)
    options = RunOptions(steps=steps, warmstart_steps=WARM_START.get(name, 200), workers=workers)
    runtime = LocalRuntime(plan, path.parent, options, CpuExecutors)
    runtime.build()
    result = runtime.run()
    tokens = sum(m["samples"] * m["response_len"] for m in result.metrics)
    shares = bubble_shares(result.spans, result.wall_s)
    predicted = simulate(plan, steps, RooflinePricing(plan, calibration)).step_time
    return {"step_s": round(result.wall_s / steps, 4), "tokens_per_s": round(tokens / result.wall_s, 1),
            "simulated_step_s": round(predicted, 4),
            "bubbles": {c: round(shares[c], 4) for c in SHOWN}}, calibration


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def table(report: dict) -> str:
    lines = ["| pipeline | schedule | step (s) | tokens/s | vs sync | simulated step (s) | "
             + " | ".join(SHOWN) + " |", "|---" * (6 + len(SHOWN)) + "|"]
    for name, runs in report["pipelines"].items():
        for schedule, r in runs.items():
            ratio = runs["sync"]["step_s"] / r["step_s"] if "sync" in runs else float("nan")
            lines.append(f"| {name} | {schedule} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {ratio:.2f}x | "
                         f"{r['simulated_step_s']:.3f} | "
                         + " | ".join(f"{100 * r['bubbles'][c]:.0f}%" for c in SHOWN) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    parser.add_argument("--workers", choices=("processes", "threads"), default="processes")
    args = parser.parse_args()
    report = {"machine": machine(), "steps": args.steps, "workers": args.workers, "pipelines": {}}
    calibration = None
    for name in args.pipelines:
        report["pipelines"][name] = {}
        for schedule in SCHEDULES:
            report["pipelines"][name][schedule], calibration = measure(name, schedule, args.steps, args.workers,
                                                                       calibration)
            print(f"{name} {schedule}: {report['pipelines'][name][schedule]}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


if __name__ == "__main__":
    main()
