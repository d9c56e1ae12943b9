"""Agentic RL on the CPU: tiny_agentic's greedy held-out accuracy with tools before and after RL,
how often its episodes call the tool and get the right number back, the RL wall time, and the
share of worker time lost to tool waits (measured, aspc.accounting.measured). Figures go to
bench/RESULTS.md ("Agentic RL on the CPU").

    python bench/bench_agentic.py [--seeds 0 1] [--steps 40] [--warmstart 800]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from aspc.accounting.measured import bubble_shares
from aspc.backends.cpu.executors import CpuExecutors
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.cli.toolchain import compile_with_passes

PIPELINE = Path(__file__).resolve().parent.parent / "pipelines" / "tiny_agentic.aspl"
HELD_OUT = 256


def one_seed(seed: int, steps: int, warmstart: int) -> str:
    plan = compile_with_passes(PIPELINE, []).plan()
    runtime = LocalRuntime(plan, PIPELINE.parent, RunOptions(steps=steps, warmstart_steps=warmstart, seed=seed),
                           CpuExecutors)
    runtime.build()
    before = runtime.executors.evaluate_episodes(HELD_OUT)
    result = runtime.run()
    after = runtime.executors.evaluate_episodes(HELD_OUT)
    tool_wait = bubble_shares(result.spans, result.wall_s)["tool_wait"]
    return (f"| {seed} | {before['accuracy']:.3f} → {after['accuracy']:.3f} | {before['called']:.2f} → "
            f"{after['called']:.2f} | {before['right_calls']:.3f} → {after['right_calls']:.3f} | "
            f"{result.wall_s:.0f} s | {100 * tool_wait:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmstart", type=int, default=800)
    args = parser.parse_args()
    print("| seed | accuracy before → after | called a tool | right calls | RL wall time | tool_wait |")
    print("|---|---|---|---|---|---|")
    for seed in args.seeds:
        print(one_seed(seed, args.steps, args.warmstart), flush=True)


if __name__ == "__main__":
    main()
