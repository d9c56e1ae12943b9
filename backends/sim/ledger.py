"""Bubble accounting: every device-second of a run in exactly one category, plus trace spans.

Busy time is recorded as it happens; idle time is classified afterwards from the intervals:
a generation instance idle while a peer of its stage is busy is a skewness bubble, otherwise it
waits for released input (weights, prompts) — a sorting bubble; a learner idle while finished
samples are held back (incomplete groups, a streaming unit, the step barrier) is a sorting
bubble, otherwise idle. Whatever no resource accounts for is idle.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from aspc.trace import Span

CATEGORIES = ("useful", "padding", "skewness", "sorting", "sync", "idle")


@dataclass
class Ledger:
    device_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    spans: list[Span] = field(default_factory=list)

    def add(self, category: str, device_seconds: float) -> None:
        self.device_seconds[category] += device_seconds

    def span(self, track: str, start: float, end: float, category: str, label: str, devices: int) -> None:
        if end <= start:
            return
        self.spans.append(Span(track, start, end, category, label))
        self.add(category, (end - start) * devices)

    def close(self, total_device_seconds: float) -> dict[str, float]:
        accounted = sum(v for k, v in self.device_seconds.items() if k != "idle")
        self.device_seconds["idle"] = max(0.0, total_device_seconds - accounted)
        return {c: self.device_seconds.get(c, 0.0) for c in CATEGORIES}


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
