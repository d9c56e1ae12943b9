"""Automatic placement on the paper workloads (bench/RESULTS.md, "Automatic placement").

For each file: the search time of auto-place (the cost model over every layout), the layout it
chooses and its predicted e2e tokens/s/device, `aspc tune`'s confirmation time, and then, each
simulated for --steps steps: asp at the layout as written, asp at the tuned layout (throughput and
efficiency = bubble-free bound / step time), sync at its own best layout, and sync@colocated.

  .venv/bin/python bench/bench_auto_place.py pipelines/grpo_7b.aspl ... [--steps 20]

A file whose schedule bounds the search (`max_staleness`, `max_pack`, `max_buckets`) is tuned with
those settings too (the layout line shows them); sync searches its own micro-batch budget.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from aspc.cli.backends import simulator_pricing
from aspc.cli.tune import CONFIRM_STEPS, TUNED_SOURCE, tune
from aspc.drivers.sim.result import simulate
from aspc.frontend.compiler import compile_file, compile_source
from aspc.frontend.layouts import BaselineUnavailable, compile_baseline
from aspc.passes.layout_search import search
from aspc.cli.toolchain import run_schedule


def simulated(text: str, base: Path, schedule: str, steps: int):
    plan = run_schedule(compile_source(text, TUNED_SOURCE, None, base), schedule).plan()
    return simulate(plan, steps, simulator_pricing(plan))


def measure(path: str, steps: int, confirm: int) -> list[str]:
    compilation, base = compile_file(path), Path(path).parent
    started = time.perf_counter()
    ranked = search(compilation.graph, "asp")
    search_s = time.perf_counter() - started
    asp = tune(compilation, "asp", confirm, CONFIRM_STEPS, base)
    sync = tune(compilation, "sync", confirm, CONFIRM_STEPS, base)
    rows = [f"{Path(path).stem}: {len(ranked)} layouts searched in {search_s:.2f} s; predicted best "
            f"{ranked[0].estimate.tps:.1f} ({ranked[0].describe()}); asp confirmed in {asp.confirm_s:.1f} s, "
            f"sync in {sync.confirm_s:.1f} s"]
    results = {}
    if asp.written is not None:
        results["asp@written"] = simulated(asp.written.text, base, "asp", steps)
    results["asp@auto"] = simulated(asp.best.text, base, "asp", steps)
    results["sync@best"] = simulated(sync.best.text, base, "sync", steps)
    try:
        baseline = compile_baseline(compilation, base) if asp.written is not None else None
    except BaselineUnavailable:  # e.g. a searched budget: the default micro_tokens cannot hold a sequence
        baseline = None
    if baseline is not None:
        plan = run_schedule(baseline, "sync").plan()
        results["sync@colocated"] = simulate(plan, steps, simulator_pricing(plan))
    for name, r in results.items():
        rows.append(f"  {name:15} {r.e2e_tps:8.1f} tokens/s/device  step {r.step_time:8.2f} s  "
                    f"efficiency {r.efficiency:.1%}")
    rows.append(f"  asp@auto layout: {asp.best.ranked.describe()} (predicted "
                f"{asp.best.ranked.estimate.tps:.1f}); sync@best: {sync.best.ranked.describe()}")
    rows.append(f"  asp@auto / sync@best = {results['asp@auto'].e2e_tps / results['sync@best'].e2e_tps:.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--confirm", type=int, default=3)
    args = parser.parse_args()
    for path in args.files:
        print("\n".join(measure(path, args.steps, args.confirm)), flush=True)


if __name__ == "__main__":
    main()
