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

from aspc.accounting.bubbles import CATEGORIES, gaps, merge, split_by, step_function_positive  # noqa: F401 - re-exported
from aspc.accounting.trace import Span


@dataclass
class Ledger:
    device_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    spans: list[Span] = field(default_factory=list)
    # segments booked but not yet made spans: (where in `spans` they go, track, segments, until)
    deferred: list[tuple[int, str, list, float]] = field(default_factory=list)

    def add(self, category: str, device_seconds: float) -> None:
        self.device_seconds[category] += device_seconds

    def span(self, track: str, start: float, end: float, category: str, label: str, devices: int) -> None:
        if end <= start:
            return
        self.spans.append(Span(track, start, end, category, label))
        self.add(category, (end - start) * devices)

    def segments(self, track: str, segments: list[tuple[float, float, str]], until: float, devices: int) -> float:
        """`span` of each (start, end, category) cut at `until`, labelled with its category (a
        generation instance's hundreds of thousands of decode segments); returns the seconds booked
        (per device, summed in order). The device-seconds are booked now; the spans are made only
        if someone reads them (`all_spans`: a trace, a plot, a report), not for every summary."""
        booked, seconds = self.device_seconds, 0
        for start, end, category in segments:
            end = min(end, until)
            if end > start:
                booked[category] += (end - start) * devices
                seconds += end - start
        self.deferred.append((len(self.spans), track, segments, until))
        return seconds

    def all_spans(self) -> list[Span]:
        """Every span in the order booked, the deferred segments' made in their place."""
        if not self.deferred:
            return self.spans
        out, taken = [], 0
        for position, track, segments, until in self.deferred:
            out += self.spans[taken:position]
            taken = position
            out += [Span(track, start, min(end, until), category, category)
                    for start, end, category in segments if min(end, until) > start]
        return out + self.spans[taken:]

    def close(self, total_device_seconds: float) -> dict[str, float]:
        accounted = sum(v for k, v in self.device_seconds.items() if k != "idle")
        self.device_seconds["idle"] = max(0.0, total_device_seconds - accounted)
        return {c: self.device_seconds.get(c, 0.0) for c in CATEGORIES}
