"""Padding of the pack pass on the four paper workloads' declared length distributions.

For each workload: the asp schedule's pack settings for its train stage (token budget, buckets,
dp ranks), applied to freshly sampled steps (not the steps the pass saw when it chose buckets).
Prints a Markdown table for bench/RESULTS.md.

    python bench/bench_pack.py
"""
from __future__ import annotations

from pathlib import Path

from aspc.ir.graph import StageKind
from aspc.algorithms.packing import padding_report
from aspc.cli.toolchain import compile_with_passes
from aspc.costmodel.workload import sample_step

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b"]
HELD_OUT_STEPS = range(100, 103)  # the pass sampled steps 0..3


def row(name: str) -> str:
    graph = compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", schedule="asp").graph
    train = graph.stages_of(StageKind.TRAIN)[0]
    data = next(iter(graph.data.values()))
    lengths = [s.tokens for step in HELD_OUT_STEPS for s in sample_step(data, step)]
    longest = data.max_prompt + data.max_response
    ranks = train.parallel.dp
    shape = train.micro_batching
    buckets = shape.buckets
    unit = train.streaming.micro if train.streaming else data.samples_per_step  # what the stage receives
    report = padding_report(lengths, shape.tokens, longest, buckets, ranks, unit)
    mean = sum(lengths) / len(lengths)
    return (f"| {name} | {len(lengths)} | {mean:.0f} / {longest} | {shape.tokens} | {ranks} | {unit} | "
            f"{', '.join(map(str, buckets))} | {report.pad_to_max:.1%} | {report.pad_to_longest:.1%} | "
            f"{report.packed_buckets:.1%} |")


def main() -> None:
    print("| workload | sequences | mean / max tokens | pack tokens | dp ranks | unit | buckets | "
          "pad to max | pad to longest | packed + buckets |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in WORKLOADS:
        print(row(name))


if __name__ == "__main__":
    main()
