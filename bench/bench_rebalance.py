"""Runtime rebalancing on and off (`schedule asp { rebalance = true }`), simulated: every bundled
paper workload as written, grpo_7b with drifting responses (short at first, 30% longer each step,
with long prompts, on four tp=2 instances), and a drift that turns generation-bound within the
run (35% a step up to an 8k cap, over `--reversing-steps`). Figures go to bench/RESULTS.md
("Runtime rebalancing") and decide the option's default (docs/simulator.md).

    python bench/bench_rebalance.py [--steps 12] [--reversing-steps 16]
"""
from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from aspc.backends.sim.pricing import RooflinePricing
from aspc.controller.rebalance import rebalance_policy
from aspc.drivers.sim.driver import Simulation
from aspc.drivers.sim.result import collect
from aspc.cli.toolchain import compile_with_passes

PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"
WORKLOADS = ("grpo_7b", "dapo_32b", "grpo_30b_moe", "rlhf_32b_rm", "rlaif_7b_judge", "agentic_7b")
DRIFT = {"mean = 600, sigma = 0.8": "mean = 100, sigma = 0.8, growth = 0.3",
         "uniform(min = 100, max = 600)": "uniform(min = 1k, max = 2k)",
         "instances = 2, tp = 4": "instances = 4, tp = 2",
         "on learner { tp = 4, dp = 2 }": "on learner { tp = 2, dp = 4 }",
         "tp = 4, dp = 2, loss": "tp = 2, dp = 4, loss"}
REVERSING = {**DRIFT, "mean = 600, sigma = 0.8": "mean = 60, sigma = 0.6, growth = 0.35",
             "max_response = 2k": "max_response = 8k", "micro_tokens = 8k": "micro_tokens = 16k",
             "pack = 8k": "pack = 16k"}


def with_rebalance(text: str, on: bool) -> str:
    """The schedule block with `rebalance = true|false` added."""
    return re.sub(r"(schedule asp \{[^}]*?)\s*\}", rf"\1, rebalance = {'true' if on else 'false'} }}", text, count=1)


def simulate(text: str, steps: int, folder: Path):
    path = folder / "workload.aspl"
    path.write_text(text)
    plan = compile_with_passes(path, [], "asp").plan()
    if plan.rebalance and rebalance_policy(plan) is None:
        return None, plan
    sim = Simulation(plan, steps, RooflinePricing(plan))
    sim.run()
    return (sim, collect(sim)), plan


def row(name: str, text: str, steps: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "data").symlink_to(PIPELINES / "data")
        off, _ = simulate(with_rebalance(text, False), steps, folder)
        on, _ = simulate(with_rebalance(text, True), steps, folder)
    if on is None:
        return f"| {name} | {off[1].e2e_tps:.0f} | refused: no flexible instance | — | — |"
    moves = ", ".join(f"gen[{i}]→{'trainer' if role == 'learn' else 'gen'} at {t:.0f} s" for t, i, role in on[0].moves)
    gain = off[1].wall_s / on[1].wall_s - 1
    return f"| {name} | {off[1].e2e_tps:.0f} | {on[1].e2e_tps:.0f} | {100 * gain:+.1f}% | {moves or 'none'} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reversing-steps", type=int, default=16)
    args = parser.parse_args()
    print(f"{args.steps} steps | e2e tokens/s/device off | on | gain | moves")
    print("|---|---|---|---|---|")
    for name in WORKLOADS:
        print(row(name, (PIPELINES / f"{name}.aspl").read_text(), args.steps), flush=True)
    print(row("grpo_7b, drifting responses", drifted(DRIFT), args.steps))
    print(row(f"grpo_7b, drift to 8k ({args.reversing_steps} steps)", drifted(REVERSING), args.reversing_steps))


def drifted(replacements: dict[str, str]) -> str:
    text = (PIPELINES / "grpo_7b.aspl").read_text()
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


if __name__ == "__main__":
    main()
