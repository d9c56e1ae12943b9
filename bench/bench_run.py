"""Real CPU training of the bundled CPU pipelines under sync-naive, sync and asp in one invocation,
with the simulator's prediction of each plan beside the measurement: the cost model calibrated by a
micro-benchmark of the tiny model (backends/cpu/calibrate.py) taken just before each measurement,
so that both see the same machine load, the calibrated machine's cores shared among the busy
workers (aspc/costmodel/cores.py), and the prompt and response lengths of the warm-started policy
sampled before the run (docs/simulator.md, "CPU calibration and cores"). Prints a Markdown table
(the one in bench/RESULTS.md) with the ratio predicted / measured, and with --json writes

    {"machine": {...}, "steps": N, "workers": ..., "pipelines": {NAME: {"sync-naive" | "sync" | "asp":
        {"step_s": ..., "tokens_per_s": ..., "simulated_step_s": ..., "ratio": ..., "load": [1, 5, 15 min],
         "policy_mean_lengths": {"prompt": ..., "response": ...}, "calibration": {...}, "bubbles": {...}}}}}

    python bench/bench_run.py [--steps 20] [--json OUT] [--pipelines tiny_grpo tiny_ppo ...]
                              [--workers processes|threads]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import statistics
from pathlib import Path

from aspc.accounting.measured import bubble_shares
from aspc.backends.cpu.calibrate import calibrate, policy_lengths
from aspc.backends.cpu.executors import CpuExecutors
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.drivers.sim.result import simulate
from aspc.ir.values import Call
from aspc.cli.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ("tiny_grpo", "tiny_grpo_split", "tiny_ppo", "tiny_rlhf", "tiny_rlaif", "tiny_agentic")
SCHEDULES = ("sync-naive", "sync", "asp")
WARM_START = {"tiny_agentic": 800}  # it needs the call format shown (docs/runtime.md); others: 200
SHOWN = ("useful", "skewness", "sorting", "sync", "idle", "tool_wait")


def measure(name: str, schedule: str, steps: int, workers: str) -> dict:
    """Build the run, calibrate on the torch threads its workers get, run it, and simulate it."""
    path = ROOT / "pipelines" / f"{name}.aspl"
    plan = compile_with_passes(path, schedule=schedule).plan()
    options = RunOptions(steps=steps, warmstart_steps=WARM_START.get(name, 200), workers=workers)
    runtime = LocalRuntime(plan, path.parent, options, CpuExecutors)
    runtime.build()
    calibration = calibrate(plan.model(plan.stages_of("train")[0].model).arch, threads=runtime.threads)
    simulated, lengths = with_policy_lengths(plan, runtime.executors)
    load = [round(x, 2) for x in os.getloadavg()]
    result = runtime.run()
    tokens = sum(m["samples"] * m["response_len"] for m in result.metrics)
    shares = bubble_shares(result.spans, result.wall_s)
    predicted = simulate(simulated, steps, RooflinePricing(simulated, calibration)).step_time
    step = result.wall_s / steps
    return {"step_s": round(step, 4), "tokens_per_s": round(tokens / result.wall_s, 1),
            "simulated_step_s": round(predicted, 4), "ratio": round(predicted / step, 3), "load": load,
            "policy_mean_lengths": lengths,
            "calibration": {k: round(v, 7) for k, v in dataclasses.asdict(calibration).items()},
            "bubbles": {c: round(shares[c], 4) for c in SHOWN}}


def with_policy_lengths(plan, executors, steps: int = 2):
    """The plan with the prompt and response lengths of its warm-started policy (the prompts of
    `steps` steps, their responses sampled before the run), each drawn from their empirical
    distribution (a mixture of fixed lengths); and the mean lengths. The pipelines declare lengths
    for models of real size; the tiny policy's answers are shorter (backends/cpu/calibrate.py,
    `policy_lengths`)."""
    data = plan.dataset(plan.stages_of("generate")[0].data)
    count = steps * data.prompts_per_step
    prompts = [(executors.prompt(p).ids, p * data.group + k) for p in range(count) for k in range(data.group)]
    tools = executors.tools() if plan.stages_of("environment") else None
    responses = policy_lengths(executors.generation_engine(0, 1), prompts, tools)
    measured = dataclasses.replace(data, response_lengths=_empirical(responses),
                                   prompt_lengths=_empirical([len(ids) for ids, _ in prompts[::data.group]]))
    plan = dataclasses.replace(plan, data=tuple(measured if d.name == data.name else d for d in plan.data))
    return plan, {"prompt": round(statistics.mean(len(ids) for ids, _ in prompts), 2),
                  "response": round(statistics.mean(responses), 2)}


def _empirical(lengths: list[int]) -> Call:
    counts = collections.Counter(max(n, 1) for n in lengths)
    values = sorted(counts)
    return Call("mixture", (("components", tuple(Call("fixed", (("length", n),)) for n in values)),
                            ("per", "sample"), ("weights", tuple(float(counts[n]) for n in values))))


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def table(report: dict) -> str:
    lines = ["| pipeline | schedule | step (s) | tokens/s | vs sync | simulated step (s) | ratio | load (1 min) | "
             + " | ".join(SHOWN) + " |", "|---" * (8 + len(SHOWN)) + "|"]
    for name, runs in report["pipelines"].items():
        for schedule, r in runs.items():
            speedup = runs["sync"]["step_s"] / r["step_s"] if "sync" in runs else float("nan")
            lines.append(f"| {name} | {schedule} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {speedup:.2f}x | "
                         f"{r['simulated_step_s']:.3f} | {r['ratio']:.2f} | {r['load'][0]:.2f} | "
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
    for name in args.pipelines:
        report["pipelines"][name] = {}
        for schedule in SCHEDULES:
            r = report["pipelines"][name][schedule] = measure(name, schedule, args.steps, args.workers)
            print(f"{name} {schedule}: step {r['step_s']} s, simulated {r['simulated_step_s']} s "
                  f"(ratio {r['ratio']}), load {r['load'][0]}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


if __name__ == "__main__":
    main()
