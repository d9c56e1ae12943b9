"""The paper workloads at each schedule's best layout, against the strongest sync the language
expresses (its best layout and its best mini-batching), with the drain and an ablation of asp's passes
(issue 34).

    python bench/best_layout_table.py [--steps 20] [--workloads grpo_7b,dapo_32b]

For each workload: the layout `aspc simulate --compare --best-layout` picks for sync and for asp
(aspc tune's search over every degree, confirmed until the best holds); sync at that layout with
mini_batches 1..staleness+1 (the fastest is "best sync"); asp; then asp's passes one at a time taken
away (or changed) at asp's layout, and partial rollout added (carry-over on a time-shared pool).
"gen drain" is the tail and skewness of the generation instances, in % of all device time; "bound"
the bubble-free bound's share (efficiency).
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

from aspc.backends.sim.pricing import RooflinePricing
from aspc.cli.mini_batching import with_mini_batches
from aspc.cli.toolchain import run_schedule
from aspc.cli.tune import TUNED_SOURCE, _tune
from aspc.controller.config import ControllerConfig
from aspc.drivers.sim.result import simulate
from aspc.frontend.compiler import compile_file, compile_source
from aspc.passes.schedules import schedule_for

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    print(f"steps: {args.steps}; machine: {platform.machine()}, Python {platform.python_version()}\n")
    print("| workload | run | layout | step time (s) | vs best sync | efficiency | gen drain | preempt | staleness |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        for row in _workload(name, args.steps):
            print(row)


def _workload(name: str, steps: int) -> list[str]:
    path = ROOT / "pipelines" / f"{name}.aspl"
    compilation = compile_file(path)
    best = {kind: _tune(str(path), compilation, kind, 3, 6).best for kind in ("sync", "asp")}
    source = {kind: compile_source(best[kind].text, TUNED_SOURCE, None, path.parent) for kind in best}
    asp_plan = run_schedule(source["asp"], "asp").plan()
    staleness = ControllerConfig.from_plan(asp_plan, steps).staleness
    sync_plan = run_schedule(source["sync"], "sync").plan()
    runs = [(f"sync mini_batches={m}", best["sync"], with_mini_batches(sync_plan, m)) for m in range(1, staleness + 2)]
    runs.append(("asp", best["asp"], asp_plan))
    for label, pipeline in _ablations(source["asp"].graph):
        runs.append((label, best["asp"], run_schedule(source["asp"], "asp", pipeline).plan()))
    results = [(label, tried, plan, simulate(plan, steps, RooflinePricing(plan))) for label, tried, plan in runs]
    best_sync = min((r for label, _, _, r in results if label.startswith("sync")), key=lambda r: r.step_time)
    return [_row(name, label, tried, plan, r, best_sync) for label, tried, plan, r in results]


def _ablations(graph) -> list[tuple[str, str]]:
    """asp's pass pipeline (passes/schedules.py) with one pass taken away or changed, and with partial
    rollout added (carry-over on a time-shared pool)."""
    o = schedule_for(graph, "asp").option
    base = {"continuous-batching": "continuous-batching", "place": "place",
            "async-decouple": f"async-decouple{{staleness={o('staleness')}}}",
            "queue-aware-dispatch": f"queue-aware-dispatch{{policy={o('dispatch')}}}",
            "stream": f"stream{{micro={o('stream')}}}",
            "pack": f"pack{{tokens={o('pack') or 0},buckets={o('buckets')}}}"}
    if o("partial_rollout"):
        base["partial-rollout"] = f"partial-rollout{{max_split={o('partial_rollout')}}}"
    needs = {"async-decouple": ("async-decouple", "partial-rollout")}  # partial rollout needs the decoupling
    out = [(f"asp without {name}", ",".join(v for k, v in base.items() if k not in needs.get(name, (name,))))
           for name in ("async-decouple", "stream", "partial-rollout") if name in base]
    changed = {"asp, round-robin dispatch": {"queue-aware-dispatch": "queue-aware-dispatch{policy=round_robin}"},
               "asp, no static buckets": {"pack": f"pack{{tokens={o('pack') or 0},buckets=0}}"}}
    if not o("partial_rollout"):
        changed["asp + partial-rollout{1}"] = {"pack": base["pack"] + ",partial-rollout{max_split=1}"}
    out += [(label, ",".join({**base, **change}.values())) for label, change in changed.items()]
    return out


def _row(name: str, label: str, tried, plan, r, best_sync) -> str:
    stale = ", ".join(f"{k}:{v}" for k, v in r.staleness.items())
    return (f"| {name} | {label} | {tried.ranked.describe().replace(' | ', '; ')} | {r.step_time:.1f} | "
            f"{best_sync.step_time / r.step_time:.2f}x | {100 * r.efficiency:.1f}% | "
            f"{100 * _generation_drain(plan, r):.1f}% | {100 * r.share('preempt'):.1f}% | {stale} |")


def _generation_drain(plan, r) -> float:
    """Tail and skewness booked on the generation instances' tracks, over all device time."""
    gen = plan.stages_of("generate")[0]
    devices = {f"{gen.name}[{i.index}]": i.device_count for i in gen.instances}
    seconds = sum((s.end - s.start) * devices[s.track] for s in r.spans
                  if s.track in devices and s.category in ("tail", "skewness"))
    return seconds / (r.devices * r.wall_s)


if __name__ == "__main__":
    main()
