"""pack{tokens, buckets}: micro-batches by token budget, balanced across data-parallel ranks,
padded only to a few static shape buckets.

Removes: padding bubble (pad tokens in micro-batches padded to their longest sequence).
Assumes: every sequence (max_prompt + max_response) fits in `tokens`. Runs after `stream`, if
any, so that it packs the streamed units of `micro` samples the stages will really receive.
For each stage that runs a forward or backward pass (train, reference, critic) the pass samples
the declared length distribution, splits a step's sequences across the stage's dp ranks with
Karmarkar-Karp, packs each rank's share first-fit-decreasing into micro-batches of at most
`tokens`, and chooses `buckets` micro-batch sizes (the largest is `tokens`) that minimise padding,
so a graph-mode executor compiles once per bucket. buckets=0 keeps dynamic shapes (remove-padding,
eager), which is what the synchronous baseline does.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from aspc.ir.graph import MicroBatchShape, Stage, StageGraph, StageKind
from aspc.ir.kinds import kinds_where
from aspc.costmodel.workload import step_lengths
from aspc.passes.base import Pass, PassError
from aspc.algorithms.packing import bucket_for, choose_buckets, micro_batches

PACKED = kinds_where(lambda rule: rule.packed)
SAMPLED_SEQUENCES = 2048  # at least this many sampled sequences (whole steps, at most 4) choose buckets


@dataclass(frozen=True)
class Pack(Pass):
    name = "pack"
    after = {"stream": "it packs the streamed units of `micro` samples the stages will really receive"}
    bubble = "padding"
    tokens: int = 0  # 0: each stage's micro_tokens (the train stages' for forward-only stages)
    buckets: int = 4
    align: int = 64

    def apply(self, graph: StageGraph) -> StageGraph:
        if self.tokens < 0 or self.buckets < 0 or self.align < 1:
            raise PassError("tokens and buckets must be >= 0, align >= 1")
        packed: dict = {}  # (data, tokens, micro, ranks) -> fills: a reference and a train stage pack alike
        stages = [self._pack(graph, s, packed) if s.kind in PACKED else s for s in graph.stages()]
        return graph.rebuilt(stages, graph.flows())

    def _pack(self, graph: StageGraph, stage: Stage, packed: dict) -> Stage:
        tokens = self.tokens or stage.option("micro_tokens") or _train_tokens(graph)
        data = _upstream_data(graph, stage)
        longest = max((d.max_prompt + d.max_response for d in data), default=1)
        if tokens < longest:
            raise PassError(f"tokens={tokens} cannot hold one sequence of {longest} tokens "
                            f"(max_prompt + max_response) for stage '{stage.name}'")
        micro = stage.streaming.micro if stage.streaming else None
        ranks = stage.parallel.dp  # context parallelism splits sequences, it adds no ranks
        key = (tuple(d.name for d in data), tokens, micro, ranks)
        if key not in packed:
            packed[key] = _fills(data, tokens, micro, ranks)
        fills = packed[key]
        buckets = choose_buckets(fills, self.buckets, tokens, self.align) if self.buckets else ()
        fraction = None
        if buckets:  # the padding of these very micro-batches, each padded to its bucket
            fraction = round(1 - sum(fills) / sum(bucket_for(f, buckets) for f in fills), 4)
        shape = MicroBatchShape(tokens, tuple(buckets), "karmarkar_karp", "buckets" if buckets else "none", fraction)
        return stage.with_results(micro_batching=shape)


def _fills(data, tokens: int, micro: int | None, ranks: int) -> list[int]:
    """The token fill of every micro-batch the sampled steps pack into (per streamed unit of
    `micro` samples when streamed), over `ranks` data-parallel ranks."""
    lengths = [_tokens(*step_lengths(d, step), d.group) for d in data for step in range(_steps(d))]
    if micro:  # streamed: a micro-batch packs one unit of `micro` samples, not a whole step
        lengths = [step[i:i + micro] for step in lengths for i in range(0, len(step), micro)]
    return [sum(mb) for step in lengths for rank in micro_batches(step, tokens, ranks) for mb in rank]


def _tokens(prompts: list[int], responses: list[int], group: int) -> list[int]:
    """Each sample's sequence length (sample k answers prompt k // group)."""
    return [prompts[k // group] + response for k, response in enumerate(responses)]


def _steps(data) -> int:
    return max(1, min(4, -(-SAMPLED_SEQUENCES // data.samples_per_step)))


def _train_tokens(graph: StageGraph) -> int:
    return max((t.option("micro_tokens") for t in graph.stages_of(StageKind.TRAIN)), default=16384)


def _upstream_data(graph: StageGraph, stage: Stage):
    names = {graph.stage(n).data for n in nx.ancestors(graph.nx_graph(), stage.name)}
    return [graph.data[n] for n in sorted(x for x in names if x in graph.data)]
