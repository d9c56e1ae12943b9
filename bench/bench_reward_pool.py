"""The reward pool: a reward model or an LLM judge on its own pool, or colocated on the policy's
learner pool (time-sharing the trainer's devices), under sync-naive, sync and asp in the simulator.

    python bench/bench_reward_pool.py [--steps 20]

Prints Markdown for bench/RESULTS.md: per paper pipeline (pipelines/rlhf_32b_rm.aspl,
pipelines/rlaif_7b_judge.aspl) and placement, the step time, e2e_tps, the reward stage's share of
the busy device-seconds and the utilization of the pool it runs on.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.driver import Simulation
from aspc.drivers.sim.result import collect
from aspc.cli.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ["sync-naive", "sync", "asp"]
# pipeline -> (its reward pool's line, the reward stage's placement, the colocated placement)
WORKLOADS = {
    "rlhf_32b_rm": ("pool rm_pool = 910b3 x 8\n", "on rm_pool { tp = 4, instances = 2 }",
                    "on learner { tp = 4, dp = 8 }"),
    "rlaif_7b_judge": ("pool judges = 910b3 x 16\n", "on judges { tp = 4, instances = 4 }",
                       "on learner { tp = 4, dp = 2 }"),
}


def variants(name: str, folder: Path) -> dict[str, Path]:
    """The pipeline as written (separate reward pool) and with the reward stage on the learner pool."""
    text = (ROOT / "pipelines" / f"{name}.aspl").read_text().replace('jsonl("data/math.jsonl")', 'synthetic("arith")')
    pool, separate, colocated = WORKLOADS[name]
    assert pool in text and separate in text, name
    out = {"separate": folder / f"{name}.aspl", "colocated": folder / f"{name}_colocated.aspl"}
    out["separate"].write_text(text)
    out["colocated"].write_text(text.replace(pool, "").replace(separate, colocated))
    return out


def reward_share(sim: Simulation, result) -> tuple[str, float, float]:
    """(the reward stage's pool, its scoring's share of all busy device-seconds, that pool's utilization)."""
    stage = next(s for s in sim.plan.stages if s.kind == "reward")
    devices = {ex.spec.name: ex.devices for ex in sim.executors}
    scoring = sum((s.end - s.start) * devices[s.track] for s in result.spans
                  if s.track in devices and s.label.startswith("reward step"))
    busy = sum(b for _, b in result.pools.values())
    return stage.pool, scoring / busy, result.pool_utilization(stage.pool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"steps: {args.steps}; machine: {platform.machine()}, Python {platform.python_version()}\n")
    print("| workload | reward pool | devices | schedule | step time (s) | e2e_tps | vs separate | "
          "reward share of busy device-time | reward pool util | efficiency | sim wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in WORKLOADS:
            files = variants(name, Path(tmp))
            separate: dict[str, float] = {}
            for placement, path in files.items():
                for schedule in SCHEDULES:
                    plan = compile_with_passes(path, schedule=schedule).plan()
                    start = time.perf_counter()
                    sim = Simulation(plan, args.steps, RooflinePricing(plan))
                    sim.run()
                    r = collect(sim)
                    wall = time.perf_counter() - start
                    pool, share, util = reward_share(sim, r)
                    if placement == "separate":
                        separate[schedule] = r.step_time
                    print(f"| {name} | {placement} ({pool}) | {r.devices} | {schedule} | {r.step_time:.1f} | "
                          f"{r.e2e_tps:.1f} | {separate[schedule] / r.step_time:.2f}x | {100 * share:.1f}% | "
                          f"{100 * util:.1f}% | {100 * r.efficiency:.1f}% | {wall:.1f} |")


if __name__ == "__main__":
    main()
