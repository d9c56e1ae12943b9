"""The bubble categories and the interval arithmetic that classifies idle time, shared by the
simulator's ledger and the runtimes' accounting (a neutral home: neither imports the other).

Every device-second is one of CATEGORIES; see DESIGN.md for what each means.
"""
from __future__ import annotations

# tail: a generation instance decoding below its saturated batch (a few long-tail sequences left);
# tool_wait: a generation instance holds live episodes and every one of them waits on a tool call
CATEGORIES = ("useful", "padding", "tail", "skewness", "sorting", "sync", "idle", "tool_wait")


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
    """(covered parts, uncovered parts) of an interval against merged intervals."""
    uncovered = gaps(cover, *interval)
    a, b = interval
    covered = gaps(uncovered, a, b)
    return covered, uncovered


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
