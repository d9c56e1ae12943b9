"""The timelines' data: every schedule's spans, a row per instance or learner.

Times are integer ticks of one clock (TICKS for the longest schedule), so a span costs a few digits
in the page; the page draws each schedule fitted to its own length or all on one axis. A schedule
with more than EXACT_LIMIT spans is summarised: per row, spans shorter than a bin (1/BINS of that
schedule's length, so a short schedule fitted to the width is as detailed as a long one) are
gathered into their bin, which keeps its time extent, its most common category and each category's
share; longer spans and weight syncs stay exact.
"""
from __future__ import annotations

import re
from collections import defaultdict

from aspc.accounting.bubbles import CATEGORIES
from aspc.accounting.trace import Span, coalesce
from aspc.report.model import Result

TICKS = 1_000_000
BINS = 2000
EXACT_LIMIT = 20_000
SHOWN = CATEGORIES + ("tool",)  # "tool": a tool runner's call (host processes, not devices)
ALWAYS_EXACT = ("sync",)  # weight syncs and pool switches are marked one by one
TOOLS_ROW = "tools"


def timeline_data(results: list[Result]) -> dict:
    axis = max((r.wall_s for r in results), default=0.0) or 1.0
    labels: dict[str, int] = {"": 0}
    schedules = [_schedule(r, axis / TICKS, labels) for r in results]
    return {"ticks": TICKS, "tick_s": axis / TICKS, "categories": list(SHOWN), "labels": list(labels),
            "schedules": schedules}


def _schedule(result: Result, tick: float, labels: dict[str, int]) -> dict:
    spans = coalesce(result.spans)
    summarise = len(spans) > EXACT_LIMIT
    rows = []
    width = max(1, round(result.wall_s / tick / BINS))  # a bin of this schedule's own length
    for name, members in _rows(spans):
        encoded = [_encode(s, tick, labels) for s in members]
        if summarise:
            encoded = _summarised(encoded, width)
        rows.append({"name": name, "spans": encoded})
    return {"name": result.schedule, "wall_s": result.wall_s, "spans": len(spans), "summarised": summarise,
            "tool_calls": result.tool_calls, "rows": rows}


def _rows(spans: list[Span]) -> list[tuple[str, list[Span]]]:
    """Generation instances, then the learner side, then one row for all tool runners."""
    by_row: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_row[TOOLS_ROW if s.category == "tool" else s.track].append(s)
    names = sorted(by_row, key=lambda n: (n == TOOLS_ROW, not n.startswith("gen"), _natural(n)))
    return [(n, sorted(by_row[n], key=lambda s: s.start)) for n in names]


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _encode(span: Span, tick: float, labels: dict[str, int]) -> list[int]:
    """[start, end, category, label]: label 0 when it only repeats the category."""
    label = "" if span.label == span.category else span.label
    index = labels.setdefault(label, len(labels))
    start = round(span.start / tick)
    return [start, max(start + 1, round(span.end / tick)), SHOWN.index(span.category), index]


def _summarised(spans: list[list[int]], width: int) -> list[list]:
    """Short spans gathered into their bin: [start, end, dominant category, -count, [[category,
    permille], ...]]; long spans and ALWAYS_EXACT categories as they are. Summaries come first
    (the page draws exact spans over them)."""
    exact, bins = [], defaultdict(list)
    for s in spans:
        if s[1] - s[0] >= width or SHOWN[s[2]] in ALWAYS_EXACT:
            exact.append(s)
        else:
            bins[s[0] // width].append(s)
    return [_bin(members) for _, members in sorted(bins.items())] + exact


def _bin(members: list[list[int]]) -> list:
    if len(members) == 1:
        return members[0]
    time: dict[int, int] = defaultdict(int)
    for s in members:
        time[s[2]] += s[1] - s[0]
    total = sum(time.values()) or 1
    shares = [[c, round(1000 * t / total)] for c, t in sorted(time.items())]
    dominant = max(time, key=time.get)
    return [min(s[0] for s in members), max(s[1] for s in members), dominant, -len(members), shares]
