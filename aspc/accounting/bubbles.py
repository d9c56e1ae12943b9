"""The bubble categories and the interval arithmetic that classifies idle time, shared by the
simulator's ledger and the runtimes' accounting (a neutral home: neither imports the other).

Every device-second is one of CATEGORIES; see DESIGN.md for what each means.
"""
from __future__ import annotations

import bisect

# tail: a generation instance decoding below its saturated batch (a few long-tail sequences left);
# preempt: a generation instance computing again the KV of sequences it preempted (its cache was full);
# tool_wait: a generation instance holds live episodes and every one of them waits on a tool call
CATEGORIES = ("useful", "padding", "tail", "preempt", "skewness", "sorting", "sync", "idle", "tool_wait")
# how every picture draws them (the PNG plot and the report page), and a tool runner's own spans
COLORS = {"useful": "#2e7d32", "padding": "#f9a825", "tail": "#ff8a65", "preempt": "#ad1457", "skewness": "#c62828",
          "sorting": "#6a1b9a", "sync": "#1565c0", "idle": "#bdbdbd", "tool_wait": "#ef6c00", "tool": "#8d6e63"}


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        elif end > start:
            out.append([start, end])
    return [(a, b) for a, b in out]


def gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of [start, end] not covered by the merged intervals `busy`."""
    out, cursor = [], start
    for a, b in merge(busy):
        if b <= cursor:
            continue
        if a > cursor:
            out.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if cursor < end:
        out.append((cursor, end))
    return [(a, b) for a, b in out if b > a]


def split_by(interval: tuple[float, float], cover: list[tuple[float, float]]):
    """(covered parts, uncovered parts) of an interval against merged intervals (sorted and
    disjoint, as merge() returns them): a binary search finds the first that can overlap it."""
    a, b = interval
    covered, uncovered, cursor = [], [], a
    i = max(bisect.bisect_left(cover, (a,)) - 1, 0)
    while i < len(cover) and cover[i][0] < b:
        start, end = cover[i]
        i += 1
        if end <= cursor:
            continue
        if start > cursor:
            uncovered.append((cursor, start))
            cursor = start
        covered.append((cursor, min(end, b)))
        cursor = min(end, b)
    if cursor < b:
        uncovered.append((cursor, b))
    return [(x, y) for x, y in covered if y > x], [(x, y) for x, y in uncovered if y > x]


def step_function_positive(points: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """Intervals where a step function (time, value) is > 0."""
    out, since = [], None
    for t, v in points:
        if v > 0 and since is None:
            since = t
        elif v <= 0 and since is not None:
            out.append((since, t))
            since = None
    if since is not None:
        out.append((since, float("inf")))
    return out
