"""Simulator speed: `aspc simulate pipelines/r1_zero_671b.aspl --steps 20` end to end (a fresh
process each time: import, compile, 20 simulated steps, the report), the line of issue 15 ("under
10 s on 2 cores"). This machine's speed drifts (a shared VM: the same code took 7.8 s and 13.4 s an
hour apart), so every run also times a fixed pure-Python loop beside it: the ratio of the two is
what compares machines and commits; the wall time is what a user waits.

    python bench/bench_sim_speed.py [--repeat 5] [--steps 20] [--file pipelines/r1_zero_671b.aspl]
        [--no-bytecode-cache]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reference_loop() -> float:
    """Seconds of a fixed interpreter-bound loop (dict, list and float work like the simulator's)."""
    start = time.perf_counter()
    table, out, total = {}, [], 0.0
    for i in range(2_000_000):
        table[i & 1023] = table.get(i & 1023, 0) + 1
        out.append(i * 0.5)
        total += out[-1] if i % 3 else -1.0
    return time.perf_counter() - start


def simulate_once(file: str, steps: int, bytecode: bool) -> float:
    """One `aspc simulate` in a fresh process. `bytecode`: Python may read and write its byte code
    cache (as a `pip install`, which compiles it, and any default Python do); without it, a machine
    with PYTHONDONTWRITEBYTECODE set (these development VMs) compiles every module on each start."""
    env = dict(os.environ)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aspc.cli.main", "simulate", file, "--steps", str(steps)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--file", default="pipelines/r1_zero_671b.aspl")
    parser.add_argument("--no-bytecode-cache", dest="bytecode", action="store_false",
                        help="compile every module on each start (PYTHONDONTWRITEBYTECODE kept as set)")
    args = parser.parse_args()
    simulate_once(args.file, 1, args.bytecode)  # warm: the page cache, and the byte code cache
    walls, loops = [], []
    for _ in range(args.repeat):  # interleaved: both see the machine in the same state
        loops.append(reference_loop())
        walls.append(simulate_once(args.file, args.steps, args.bytecode))
    cached = args.bytecode or not sys.dont_write_bytecode
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, byte code cached: {cached}")
    print(f"`aspc simulate {args.file} --steps {args.steps}`, {args.repeat} runs")
    print("| | min | median | max |\n|---|---|---|---|")
    print(f"| wall (s) | {min(walls):.2f} | {statistics.median(walls):.2f} | {max(walls):.2f} |")
    print(f"| reference loop (s) | {min(loops):.2f} | {statistics.median(loops):.2f} | {max(loops):.2f} |")
    ratios = [w / loop for w, loop in zip(walls, loops)]
    print(f"| wall / loop | {min(ratios):.1f} | {statistics.median(ratios):.1f} | {max(ratios):.1f} |")


if __name__ == "__main__":
    main()
