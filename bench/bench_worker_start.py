"""What starting and ending the process workers costs, per run: `spawn` (each child imports torch)
against the fork server (aspc/drivers/local/processes.py). Each method runs in a fresh interpreter:
RUNS runs of tiny_grpo in one process (as the test suite makes them), one RL step each and no
warm start, so what is timed is the workers' start, one step and their end.

    python bench/bench_worker_start.py [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def runs(method: str, count: int) -> list[float]:
    """In this process: `count` runs with workers started by `method`; seconds each."""
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local import processes
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.cli.toolchain import compile_with_passes

    processes.START = method
    path = ROOT / "pipelines" / "tiny_grpo.aspl"
    plan = compile_with_passes(path, [], "sync").plan()
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        run = LocalRuntime(plan, path.parent, RunOptions(steps=1, warmstart_steps=0, workers="processes"),
                           CpuExecutors)
        run.build()
        run.run()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--method", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.method:
        print(json.dumps(runs(args.method, args.runs)))
        return
    for method in ("spawn", "forkserver"):
        out = subprocess.run([sys.executable, __file__, "--runs", str(args.runs), "--method", method],
                             capture_output=True, text=True, check=True).stdout
        seconds = json.loads(out.splitlines()[-1])
        print(f"{method:10s} first run {seconds[0]:5.1f} s, later runs " + ", ".join(f"{s:.1f}" for s in seconds[1:]))


if __name__ == "__main__":
    main()
