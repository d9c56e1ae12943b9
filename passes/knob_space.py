"""The schedule settings `auto-place` searches beside the layout (asp), within the program's bounds.

  staleness  0 .. `max_staleness`, when `staleness` is not written
  pack       the micro-batch token budget: powers of two from the smallest that holds the longest
             sequence up to `max_pack` (and `max_pack` itself), when neither `pack` nor the train
             stage's `micro_tokens` is written
  buckets    1 .. `max_buckets` static shape buckets, when `buckets` is not written
A written setting is a pin (the front end refuses a bound beside it); a bound not given leaves its
setting at its value, unsearched. sync searches the budget alone (dynamic shapes, on-policy), so
that it too is compared at its best; sync-naive searches none.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from aspc.ir.graph import StageGraph, StageKind
from aspc.ir.layout import Knobs

DEFAULT_PACK = 16384  # the train stage's micro_tokens default (aspc/frontend/schema.py)
DEFAULT_BUCKETS = 4


@dataclass(frozen=True)
class KnobSpace:
    """Each setting's values (one value: not searched) and the settings searched."""

    staleness: tuple[int, ...]
    pack: tuple[int, ...]
    buckets: tuple[int, ...]
    searched: frozenset[str] = frozenset()

    @property
    def packing_searched(self) -> bool:
        return bool({"pack", "buckets"} & self.searched)

    def packings(self) -> Iterator[tuple[int, int]]:
        """(token budget, bucket count) pairs to price."""
        return itertools.product(self.pack, self.buckets)

    def knobs(self, staleness: int, packing: tuple[int, int] | None = None) -> Knobs:
        """The record of one setting: only what was searched."""
        pack, buckets = packing or (None, None)
        return Knobs(staleness if "staleness" in self.searched else None,
                     pack if "pack" in self.searched else None,
                     buckets if "buckets" in self.searched else None)

    def bounds(self) -> str:
        """What was searched, for the record: `staleness 0..2, pack 8192..32768, buckets 1..8`."""
        values = {"staleness": self.staleness, "pack": self.pack, "buckets": self.buckets}
        return ", ".join(f"{k} {min(values[k])}..{max(values[k])}" for k in ("staleness", "pack", "buckets")
                         if k in self.searched)


def knob_space(graph: StageGraph, kind: str, staleness: tuple[int, ...] | None = None) -> KnobSpace:
    """The settings of `graph`'s schedule under `kind`; `staleness` replaces the staleness values
    (`aspc tune --max-staleness`)."""
    o, written = graph.schedule.option, graph.schedule.option_span
    if kind == "sync" and o("max_pack") is not None and not _micro_tokens_written(graph):
        return KnobSpace((0,), pack_budgets(graph, o("max_pack")), (0,), frozenset({"pack"}))
    if kind != "asp":
        return KnobSpace((0,), (written_pack(graph),), (0,))
    asp = graph.schedule.kind == "asp"
    searched = set()
    stale = (o("staleness") if asp and o("staleness") is not None else 1,)
    if staleness is not None:
        stale = staleness
    elif asp and o("max_staleness") is not None and written("staleness") is None:
        stale = tuple(range(o("max_staleness") + 1))
    if len(stale) > 1:
        searched.add("staleness")
    pack = (written_pack(graph),)
    if asp and o("max_pack") is not None and written("pack") is None and not _micro_tokens_written(graph):
        pack = pack_budgets(graph, o("max_pack"))
        searched.add("pack")
    buckets = (o("buckets") if asp and o("buckets") is not None else DEFAULT_BUCKETS,)
    if asp and o("max_buckets") is not None and written("buckets") is None:
        buckets = tuple(range(1, o("max_buckets") + 1))
        searched.add("buckets")
    return KnobSpace(stale, pack, buckets, frozenset(searched))


def pack_budgets(graph: StageGraph, bound: int) -> tuple[int, ...]:
    """Powers of two from the smallest holding the longest sequence up to `bound`, and `bound`."""
    smallest = 1 << max(10, (longest_sequence(graph) - 1).bit_length())
    return tuple(sorted({b for b in (smallest << i for i in range(16)) if b <= bound} | {bound}))


def longest_sequence(graph: StageGraph) -> int:
    """max_prompt + max_response of the longest data block: the least a micro-batch must hold."""
    return max((d.max_prompt + d.max_response for d in graph.data.values()), default=1)


def written_pack(graph: StageGraph) -> int:
    """The token budget as written: the schedule's `pack`, else the train stage's micro_tokens."""
    pack = graph.schedule.option("pack") if graph.schedule.kind == "asp" else None
    trains = graph.stages_of(StageKind.TRAIN)
    return pack or max((t.option("micro_tokens") or DEFAULT_PACK for t in trains), default=DEFAULT_PACK)


def _micro_tokens_written(graph: StageGraph) -> bool:
    return any(t.option_span("micro_tokens") is not None for t in graph.stages_of(StageKind.TRAIN))


def written_staleness(graph: StageGraph) -> int:
    written = graph.schedule.option("staleness") if graph.schedule.kind == "asp" else None
    return 1 if written is None else written


def written_buckets(graph: StageGraph) -> int:
    written = graph.schedule.option("buckets") if graph.schedule.kind == "asp" else None
    return DEFAULT_BUCKETS if written is None else written
