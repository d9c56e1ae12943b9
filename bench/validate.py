"""Validation: the simulator against every published end-to-end RL throughput on Ascend we found.

    python bench/validate.py [--steps 3] [--schedule sync] [--die-proxy]

Each configuration is a file in bench/validation/ (the published layout, batch, group, lengths
and engine settings; see its header). The cost model is calibrated from single-component
measurements only (docs/calibration.md); nothing here is fitted to these figures.

Prints Markdown for bench/validation/README.md: per configuration the published figure (MindSpeed-RL's
e2e tps = (mean prompt + mean response) x samples per step / world_size / step time, which is
SimResult.e2e_tps), the prediction under the schedule the publication used (MindSpeed-RL runs
blocking = synchronous, so `sync`), their ratio and the source; then the predicted bubble breakdown.

A3 configurations are simulated on `910c` devices, one device per package of two dies, so their
e2e_tps is per package. MindSpeed-RL's world_size counts dies, and its docs say the A3 figure per
card is the logged tokens/p/s x 2; whether the published A3 figures are per card (package) or per
die is not stated, so both ratios are printed.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aspc.accounting.ledger import CATEGORIES
from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.result import simulate
from aspc.cli.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = ROOT / "bench" / "validation"
MSRL = "github.com/Ascend/MindSpeed-RL"  # mirror of gitcode.com/Ascend/MindSpeed-RL


@dataclass(frozen=True)
class Case:
    file: str           # bench/validation/<file>.aspl
    label: str          # configuration as published
    published: float    # e2e tps as published
    a3: bool            # Atlas A3: simulated per package, published figure per card or per die
    source: str
    dies: tuple[tuple[str, str], ...] = ()  # --die-proxy: text edits back to MindSpeed-RL's die layout


# --die-proxy: the A3 files at MindSpeed-RL's own die-level layout, one device per die, with a
# 910b1 standing in for a die (363.7 TF, 64 GiB, 1.6 TB/s: close to half a 910c package, but with
# the 910B's 8-device HCCS node and RoCE between nodes instead of the A3's supernode fabric).
DIE = "910b1"


CASES = [
    Case("grpo_qwen25_7b_a3", "GRPO Qwen2.5-7B, A3, 16 dies, 32x8, 2k/2k", 220, True,
         f"{MSRL} docs/zh/algorithms/grpo.md @63fefd0",
         (("910c x 8", f"{DIE} x 16"), ("instances = 8, tp = 1,", "instances = 16, tp = 1,"),
          ("on npu { tp = 1, pp = 2, dp = 4 }", "on npu { tp = 2, pp = 2, dp = 4 }"),
          ("  tp = 1, pp = 2, dp = 4, loss", "  tp = 2, pp = 2, dp = 4, loss"),
          ("max_num_seqs = 2048", "max_num_seqs = 1024"))),
    Case("grpo_qwen25_32b_a3", "GRPO Qwen2.5-32B, A3, 16 dies, 64x16, 1k/2k", 220, True,
         f"{MSRL} docs/zh/algorithms/grpo.md @63fefd0",
         (("910c x 8", f"{DIE} x 16"), ("instances = 4, tp = 2,", "instances = 4, tp = 4,"),
          ("on npu { tp = 2, pp = 4 }", "on npu { tp = 4, pp = 4 }"),
          ("  tp = 2, pp = 4, loss", "  tp = 4, pp = 4, loss"))),
    Case("grpo_qwen25_32b_a2", "GRPO Qwen2.5-32B, A2 (910B), 16 NPUs, 64x16, 1k/1k", 100, False,
         f"{MSRL} docs/zh/algorithms/grpo.md @63fefd0"),
    Case("grpo_deepseek_r1_671b_a3", "GRPO DeepSeek-V3 671B (R1-Zero), A3, 384 dies, 384x32, 1k/2k", 210, True,
         f"{MSRL} docs/zh/algorithms/grpo.md @eb89512",
         (("910c x 192", f"{DIE} x 384"),
          ("instances = 6, tp = 1, dp = 32, ep = 32,", "instances = 6, tp = 2, dp = 32, ep = 64,"),
          ("on npu { tp = 2, pp = 6, dp = 16, ep = 8 }", "on npu { tp = 4, pp = 6, dp = 16, ep = 16 }"),
          ("  tp = 2, pp = 6, dp = 16, ep = 8, loss", "  tp = 4, pp = 6, dp = 16, ep = 16, loss"))),
    Case("dapo_qwen3_30b_a3b_a3", "DAPO Qwen3-30B-A3B, A3, 16 dies, 32x8, 2k/2k", 44, True,
         f"{MSRL} docs/zh/algorithms/dapo.md @b41f986",
         (("910c x 8", f"{DIE} x 16"),
          ("instances = 2, tp = 1, dp = 4, ep = 4,", "instances = 2, tp = 1, dp = 8, ep = 8,"),
          ("  tp = 2, dp = 4, ep = 2, loss", "  tp = 4, dp = 4, ep = 2, loss"),
          ("max_num_seqs = 2048", "max_num_seqs = 1024"))),
    Case("dapo_qwen25_32b_a3_30k", "DAPO Qwen2.5-32B, A3, 64 dies, 256x16, 2k/30k", 108, True,
         f"{MSRL} docs/zh/algorithms/dapo.md @facb689",
         (("910c x 32", f"{DIE} x 64"), ("instances = 16, tp = 2,", "instances = 16, tp = 4,"),
          ("  tp = 4, pp = 2, cp = 2, dp = 2, loss", "  tp = 8, pp = 2, cp = 2, dp = 2, loss"))),
    Case("dapo_qwen25_32b_a2_20k", "DAPO Qwen2.5-32B, A2 (910B), 64 NPUs, 256x16, 2k/20k", 35, False,
         f"{MSRL} docs/zh/algorithms/dapo.md @facb689"),
    Case("ppo_qwen25_32b_a3", "PPO Qwen2.5-32B + 32B critic, A3, 64 dies, 128x8, 2k/2k", 74, True,
         f"{MSRL} docs/zh/algorithms/ppo.md @590c322",
         (("actor_npu = 910c x 16", f"actor_npu = {DIE} x 32"), ("critic_npu = 910c x 16", f"critic_npu = {DIE} x 32"),
          ("instances = 4, tp = 4,", "instances = 4, tp = 8,"),
          ("on critic_npu { tp = 4, dp = 4 }", "on critic_npu { tp = 8, dp = 4 }"),
          ("  tp = 4, dp = 4, loss", "  tp = 8, dp = 4, loss"))),
]


def phases(result) -> tuple[float, float, float]:
    """Seconds per step during which rollout, learner-side work (reference, critic, train, optimizer)
    and pool switches (offload/onload) run: the union of their spans in the trace, over steps."""
    kinds: dict[str, list[tuple[float, float]]] = {"rollout": [], "learner": [], "switch": []}
    for span in result.spans:
        if span.track.startswith("gen"):
            kind = "rollout"
        elif "switch" in span.track or span.label.startswith("offload"):
            kind = "switch"
        else:
            kind = "learner"
        kinds[kind].append((span.start, span.end))
    def union(intervals):
        total, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        return total
    return tuple(union(kinds[k]) / result.steps for k in ("rollout", "learner", "switch"))


def devices(plan) -> str:
    """The plan's devices by kind, all pools together: `910c x 16`."""
    counts: dict[str, int] = {}
    for pool in plan.pools:
        counts[pool.hardware] = counts.get(pool.hardware, 0) + pool.count
    return ", ".join(f"{kind} x {n}" for kind, n in sorted(counts.items()))


def die_layout(case: Case, directory: Path) -> Path:
    """The case's file rewritten to MindSpeed-RL's die-level layout on DIE devices (--die-proxy)."""
    text = (VALIDATION / f"{case.file}.aspl").read_text(encoding="utf-8")
    for old, new in case.dies:
        assert text.count(old) == 1, (case.file, old)
        text = text.replace(old, new)
    data = (ROOT / "pipelines" / "data" / "math.jsonl").as_posix()
    path = directory / f"{case.file}.aspl"
    path.write_text(text.replace('"../../pipelines/data/math.jsonl"', f'"{data}"'), encoding="utf-8")
    return path


def run(case: Case, steps: int, schedule: str, path: Path | None = None):
    plan = compile_with_passes(path or VALIDATION / f"{case.file}.aspl", schedule=schedule).plan()
    start = time.perf_counter()
    result = simulate(plan, steps, RooflinePricing(plan))
    return plan, result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="sync", help="schedule to simulate (MindSpeed-RL's figures: sync)")
    parser.add_argument("--die-proxy", action="store_true",
                        help=f"also simulate the A3 cases at MindSpeed-RL's die-level layout, a {DIE} per die")
    args = parser.parse_args()
    print(f"steps: {args.steps}; schedule: {args.schedule}; machine: {platform.machine()}, "
          f"Python {platform.python_version()}\n")
    rows = [(case, *run(case, args.steps, args.schedule)) for case in CASES]

    print("| configuration | simulated on | published e2e tps | predicted e2e_tps | predicted / published "
          "| ratio if the figure is per die | predicted step (s) | mean prompt + response | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, plan, r, _ in rows:
        hardware = devices(plan)
        per_die = f"{r.e2e_tps / 2 / case.published:.2f}x" if case.a3 else "—"
        unit = " (per package)" if case.a3 else ""
        print(f"| {case.label} | {hardware} | {case.published:g} | {r.e2e_tps:.1f}{unit} | "
              f"{r.e2e_tps / case.published:.2f}x | {per_die} | {r.step_time:.1f} | "
              f"{r.mean_prompt:.0f} + {r.mean_response:.0f} | {case.source} |")

    if args.die_proxy:
        print(f"\nA3 cases at the die-level layout, one {DIE} per die (e2e_tps per die):\n")
        print("| configuration | simulated on | published e2e tps | predicted e2e_tps (per die) "
              "| ratio if the figure is per die | ratio if the figure is per package (x 2) | predicted step (s) |")
        print("|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as directory:
            for case in CASES:
                if not case.dies:
                    continue
                plan, r, _ = run(case, args.steps, args.schedule, die_layout(case, Path(directory)))
                hardware = devices(plan)
                print(f"| {case.label} | {hardware} | {case.published:g} | {r.e2e_tps:.1f} | "
                      f"{r.e2e_tps / case.published:.2f}x | {2 * r.e2e_tps / case.published:.2f}x | "
                      f"{r.step_time:.1f} |")

    print("\nPredicted device-time breakdown (share of devices x wall time):\n")
    print("| configuration | rollout / learner / switch per step (s) | " + " | ".join(CATEGORIES)
          + " | sim wall (s) |")
    print("|---|---|" + "---|" * len(CATEGORIES) + "---|")
    for case, _, r, wall in rows:
        split = " / ".join(f"{s:.1f}" for s in phases(r))
        print(f"| {case.file} | {split} | " + " | ".join(f"{100 * r.share(c):.1f}%" for c in CATEGORIES)
              + f" | {wall:.1f} |")


if __name__ == "__main__":
    main()
