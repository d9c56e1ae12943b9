"""The paper table: the four paper workloads under sync-naive, sync and asp in the simulator.

    python bench/paper_table.py [--steps 20]

Prints Markdown for bench/RESULTS.md: e2e_tps, speedups, efficiency against the bubble-free
bound, the bubble breakdown and staleness, per workload.
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from aspc.accounting.ledger import CATEGORIES
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.result import simulate
from aspc.plan.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b"]
SCHEDULES = ["sync-naive", "sync", "asp"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"steps: {args.steps}; machine: {platform.machine()}, Python {platform.python_version()}\n")
    print("| workload | schedule | step time (s) | e2e_tps | asp vs this | efficiency | "
          + " | ".join(CATEGORIES) + " | staleness | sim wall (s) |")
    print("|---|---|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|")
    for name in WORKLOADS:
        results = {}
        for schedule in SCHEDULES:
            plan = compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", schedule=schedule).plan()
            start = time.perf_counter()
            results[schedule] = (simulate(plan, args.steps, RooflinePricing(plan)), time.perf_counter() - start)
        asp = results["asp"][0]
        for schedule, (r, wall) in results.items():
            stale = ", ".join(f"{k}:{v}" for k, v in r.staleness.items())
            print(f"| {name} | {schedule} | {r.step_time:.1f} | {r.e2e_tps:.1f} | "
                  f"{asp.e2e_tps / r.e2e_tps:.2f}x | {100 * r.efficiency:.1f}% | "
                  + " | ".join(f"{100 * r.share(c):.1f}%" for c in CATEGORIES) + f" | {stale} | {wall:.1f} |")


if __name__ == "__main__":
    main()
