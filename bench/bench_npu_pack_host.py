"""The NPU trainer's host-side cost of one streamed unit: backends/ascend/packing.pack, which builds
every packed row of the unit (token ids, positions, labels, masks, log-probs, advantages and a dense
[T, T] attention mask) on the host before megatron's schedule runs (megatron_trainer.train).

    python bench/bench_npu_pack_host.py [--samples 32] [--budgets 4096,8192,16384,32768]

A unit of `--samples` samples with dapo_32b's length distribution (prompts uniform 100..1k, responses
lognormal around 2k, capped at 30k; those longer than the budget left out) is packed at each budget,
three times; the median is printed per unit and per row. The dense mask is T² bytes a row (1 GiB at
32k), so the cost grows with the square of the budget.
"""
from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time
from types import SimpleNamespace

from aspc.backends.ascend.packing import pack


def unit(samples: int, budget: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(samples):
        prompt = rng.randint(100, 1000)
        response = min(30000, int(rng.lognormvariate(math.log(2000) - 0.9 ** 2 / 2, 0.9)))
        if prompt + response <= budget:
            out.append(SimpleNamespace(prompt=[1] * prompt, response=[2] * response, key=(0, i), loss_mask=None,
                                       behaviour_logprobs=[-1.0] * response, ref_logprobs=None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--budgets", default="4096,8192,16384,32768")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; {args.samples} samples a unit")
    print("| budget (tokens) | samples packed | rows | host seconds a unit (median of 3) | a row |")
    print("|---|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        rollouts = unit(args.samples, budget, seed=0)
        times, rows = [], 0
        for _ in range(3):
            started = time.perf_counter()
            rows = len(pack(rollouts, budget, {r.key: 1.0 for r in rollouts}))
            times.append(time.perf_counter() - started)
        median = statistics.median(times)
        print(f"| {budget} | {len(rollouts)} | {rows} | {median:.2f} | {median / rows:.3f} |")


if __name__ == "__main__":
    main()
