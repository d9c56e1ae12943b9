"""Bubble accounting of a real run, from the spans its workers recorded, with the simulator's
categories: each worker (generation instance or learner) counts as one device. Tool runners are
host processes, not devices: their calls are in the trace but not in these shares (the time an
instance idles because every episode it holds waits on a tool is its tool_wait).

`bubble_shares(spans, end, start)` covers the window [start, end] of the run: the whole run from
0, or one step's slice of wall time (the runtimes write each step's shares into its metrics row,
over the time since the previous row, so under asp a slice holds parts of several steps)."""
from __future__ import annotations

from aspc.accounting.bubbles import CATEGORIES, gaps, merge, split_by


def bubble_shares(spans, wall: float, start: float = 0.0) -> dict[str, float]:
    spans = [s for s in spans if s.category != "tool"]
    tracks = sorted({s.track for s in spans})  # every worker, also one idle for the whole window
    inside = [(s, max(s.start, start), min(s.end, wall)) for s in spans if s.end > start and s.start < wall]
    totals = {c: 0.0 for c in CATEGORIES}
    busy = {t: merge([(a, b) for s, a, b in inside if s.track == t]) for t in tracks}
    generators = [t for t in tracks if t.startswith("gen")]
    for s, a, b in inside:
        totals[s.category] += max(0.0, b - a)
    for track in tracks:
        peers = merge([iv for t in generators if t != track for iv in busy[t]])
        for gap in gaps(busy[track], start, wall):
            if track in generators:
                skew, wait = split_by(gap, peers)
                totals["skewness"] += sum(b - a for a, b in skew)
                totals["sorting"] += sum(b - a for a, b in wait)
            else:  # the learner: idle while generation works is waiting for samples
                waiting, rest = split_by(gap, merge([iv for t in generators for iv in busy[t]]))
                totals["sorting"] += sum(b - a for a, b in waiting)
                totals["idle"] += sum(b - a for a, b in rest)
    whole = len(tracks) * (wall - start) or 1.0
    return {c: totals[c] / whole for c in CATEGORIES}
