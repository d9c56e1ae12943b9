"""The paper table: the four paper workloads under sync-naive, sync and asp in the simulator, and
sync colocated on all devices (sync@colocated: the layout a synchronous framework would run).

    python bench/paper_table.py [--steps 20]

Prints Markdown for bench/RESULTS.md: e2e_tps, speedups, efficiency against the bubble-free
bound, the bubble breakdown and staleness, per workload; then asp's speed-up against sync on the
workload's own layout and against sync@colocated.
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from aspc.accounting.ledger import CATEGORIES
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.report import COLOCATED_SYNC
from aspc.drivers.sim.result import simulate
from aspc.frontend.compiler import compile_file
from aspc.frontend.layouts import BaselineUnavailable, compile_baseline
from aspc.cli.toolchain import compile_with_passes, run_schedule

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b"]
SCHEDULES = ["sync-naive", "sync", COLOCATED_SYNC, "asp"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"steps: {args.steps}; machine: {platform.machine()}, Python {platform.python_version()}\n")
    print("| workload | schedule | step time (s) | e2e_tps | asp vs this | efficiency | "
          + " | ".join(CATEGORIES) + " | staleness | sim wall (s) |")
    print("|---|---|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|")
    speedups = []
    for name in WORKLOADS:
        results = {s: _run(name, s, args.steps) for s in SCHEDULES}
        asp = results["asp"][0]
        for schedule, (r, wall) in results.items():
            print(_row(name, schedule, r, wall, asp))
        speedups.append((name, asp, results["sync"][0], results[COLOCATED_SYNC][0]))
    print()
    print(f"| workload | asp e2e_tps | asp vs sync | asp vs {COLOCATED_SYNC} |")
    print("|---|---|---|---|")
    for name, asp, sync, colocated in speedups:
        print(f"| {name} | {asp.e2e_tps:.1f} | {_ratio(asp, sync)} | {_ratio(asp, colocated)} |")


def _run(name: str, schedule: str, steps: int):
    """(result, seconds the simulation took), or (None, 0) when the colocated baseline is not available."""
    path = ROOT / "pipelines" / f"{name}.aspl"
    try:
        plan = _baseline_plan(path) if schedule == COLOCATED_SYNC else _plan(path, schedule)
    except BaselineUnavailable as error:
        print(f"<!-- {name}: {COLOCATED_SYNC} not available: {error} -->")
        return None, 0.0
    start = time.perf_counter()
    return simulate(plan, steps, RooflinePricing(plan)), time.perf_counter() - start


def _plan(path: Path, schedule: str):
    return compile_with_passes(path, schedule=schedule).plan()


def _baseline_plan(path: Path):
    """The workload colocated on all its devices under schedule sync (aspc/frontend/layouts.py)."""
    return run_schedule(compile_baseline(compile_file(path), path.parent), "sync").plan()


def _row(name: str, schedule: str, r, wall: float, asp) -> str:
    if r is None:
        return f"| {name} | {schedule} | not available |" + " |" * (len(CATEGORIES) + 5)
    stale = ", ".join(f"{k}:{v}" for k, v in r.staleness.items())
    return (f"| {name} | {schedule} | {r.step_time:.1f} | {r.e2e_tps:.1f} | {_ratio(asp, r)} | "
            f"{100 * r.efficiency:.1f}% | " + " | ".join(f"{100 * r.share(c):.1f}%" for c in CATEGORIES)
            + f" | {stale} | {wall:.1f} |")


def _ratio(asp, base) -> str:
    return "-" if base is None else f"{asp.e2e_tps / base.e2e_tps:.2f}x"


if __name__ == "__main__":
    main()
