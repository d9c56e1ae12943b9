"""Bubble accounting of a real run, from the spans its workers recorded, with the simulator's
categories: each worker (generation instance or learner) counts as one device. Tool runners are
host processes, not devices: their calls are in the trace but not in these shares (the time an
instance idles because every episode it holds waits on a tool is its tool_wait)."""
from __future__ import annotations

from aspc.accounting.bubbles import CATEGORIES, gaps, merge, split_by


def bubble_shares(spans, wall: float) -> dict[str, float]:
    spans = [s for s in spans if s.category != "tool"]
    tracks = sorted({s.track for s in spans})
    totals = {c: 0.0 for c in CATEGORIES}
    busy = {t: merge([(s.start, min(s.end, wall)) for s in spans if s.track == t]) for t in tracks}
    generators = [t for t in tracks if t.startswith("gen")]
    for s in spans:
        totals[s.category] += max(0.0, min(s.end, wall) - s.start)
    for track in tracks:
        peers = merge([iv for t in generators if t != track for iv in busy[t]])
        for gap in gaps(busy[track], 0.0, wall):
            if track in generators:
                skew, wait = split_by(gap, peers)
                totals["skewness"] += sum(b - a for a, b in skew)
                totals["sorting"] += sum(b - a for a, b in wait)
            else:  # the learner: idle while generation works is waiting for samples
                waiting, rest = split_by(gap, merge([iv for t in generators for iv in busy[t]]))
                totals["sorting"] += sum(b - a for a, b in waiting)
                totals["idle"] += sum(b - a for a, b in rest)
    whole = len(tracks) * wall or 1.0
    return {c: totals[c] / whole for c in CATEGORIES}
