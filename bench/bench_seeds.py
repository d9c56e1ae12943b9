"""Seed sweep: does RL on a bundled CPU pipeline improve the warm-started model for every seed?

The seed sets the model's initialisation and the sampling, standing in for the floating-point
differences between machines (the warm-started model itself differs by machine). For each seed
and schedule: greedy accuracy on 256 held-out prompts before and after the RL steps, and the
sampled reward over the first and last 10 steps. Each run is its own process; --jobs run at once.

    python bench/bench_seeds.py [--pipeline tiny_grpo] [--seeds 0-7] [--steps 100] [--jobs 2]
                                [--set update.lr=3e-4 ...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = 256


def one_run(pipeline: str, seed: int, schedule: str, steps: int, overrides: list[str]) -> dict:
    """Inside a child process: warm start, accuracy, RL, accuracy."""
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.cli.toolchain import compile_with_passes

    plan = compile_with_passes(ROOT / "pipelines" / f"{pipeline}.aspl", overrides, schedule).plan()
    runtime = LocalRuntime(plan, ROOT / "pipelines", RunOptions(steps=steps, seed=seed), CpuExecutors)
    runtime.build()
    before = runtime.accuracy(HELD_OUT)
    rewards = [m["reward"] for m in runtime.run().metrics]
    after = runtime.accuracy(HELD_OUT)
    window = min(10, len(rewards))
    return {"pipeline": pipeline, "seed": seed, "schedule": schedule, "steps": len(rewards),
            "before": before, "after": after, "reward_first": sum(rewards[:window]) / window,
            "reward_last": sum(rewards[-window:]) / window, "warmstart_s": round(runtime.warmstart_s, 1)}


def _child(args, seed: int, schedule: str) -> dict:
    command = [sys.executable, __file__, "--child", "--pipeline", args.pipeline, "--seeds", str(seed),
               "--schedules", schedule, "--steps", str(args.steps), *[f"--set={o}" for o in args.overrides]]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def _table(rows: list[dict]) -> str:
    lines = ["| seed | schedule | held-out accuracy before -> after | change | sampled reward first 10 -> last 10 |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["seed"], r["schedule"])):
        lines.append(f"| {r['seed']} | {r['schedule']} | {r['before']:.3f} -> {r['after']:.3f} | "
                     f"{r['after'] - r['before']:+.3f} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} |")
    gains = [r["after"] - r["before"] for r in rows]
    rises = sum(r["reward_last"] > r["reward_first"] for r in rows)
    lines.append(f"\naccuracy change: min {min(gains):+.3f}, mean {sum(gains) / len(gains):+.3f}, "
                 f"rose in {sum(g > 0 for g in gains)}/{len(gains)} runs; sampled reward rose in {rises}/{len(rows)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="tiny_grpo")
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--schedules", default="sync,asp")
    parser.add_argument("--steps", type=int, default=100, help="RL steps after the 200-step warm start")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    runs = [(seed, schedule) for seed in _seeds(args.seeds) for schedule in args.schedules.split(",")]
    if args.child:
        print(json.dumps(one_run(args.pipeline, *runs[0], args.steps, args.overrides)))
        return
    print(f"{args.pipeline}, seeds {args.seeds}, overrides {args.overrides or 'none'}; machine: "
          f"{platform.machine()}, Python {platform.python_version()}\n", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda run: _child(args, *run), runs))
    print(_table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
