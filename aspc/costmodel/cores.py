"""Shared CPU cores as a resource of the calibrated simulation (docs/simulator.md, "CPU
calibration and cores").

On the CPU runtime every generation instance, every learner-side executor (the learner, a
reward model or judge) and every tool call in flight is a worker that computes on one thread;
`cores` of them run at full speed at once, and when more are busy the kernel shares the cores
among them evenly (processor sharing): each busy worker then progresses at cores/busy of a core, so a piece of work of c
core-seconds takes c * slowdown, slowdown = max(1, busy / cores). Other users' processes
(`background` cores, measured while calibrating) take their share too: slowdown =
max(1, (busy + background) / cores), divided by what one worker saw when the costs were
measured, max(1, (1 + background) / cores). The calibrated costs
(aspc/costmodel/calibrated.py) are core-seconds; this module keeps the slowdown current as the
simulation runs and re-times work under way when it changes:

- a generation instance's decode steps read `factor` whenever they are priced; when it changes,
  each instance first accounts its progress at the old factor, then its next event is re-timed;
- a learner-side item or a tool call keeps its remaining core-seconds; when it starts and
  whenever the factor changes, its end event is moved to now + remaining * factor.

Not re-timed: an instance's prefill or weight-load stall keeps the factor it started with.
Not counted as a worker: the controller's own process (its pipe round trips are in the decode
step, `step_round_trip`).
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field


def slowdown(busy: int, cores: int, background: float = 0.0) -> float:
    """How much longer work takes when `busy` workers and other processes keeping `background`
    cores busy share `cores` cores (processor sharing), relative to one worker among the same
    others (how the costs were calibrated)."""
    cores = max(cores, 1)
    return max(1.0, (busy + background) / cores) / max(1.0, (1 + background) / cores)


TIMED = ("executor", "tool")  # heap events that end a piece of work priced in core-seconds


@dataclass
class _Item:
    """A learner-side item or tool call under way: its remaining core-seconds as of `since`."""

    remaining: float
    since: float


@dataclass
class CoreShare:
    """The slowdown in force, and the core-seconds left to each piece of work under way."""

    cores: int
    background: float = 0.0  # cores other processes keep busy (measured while calibrating)
    factor: float = 1.0
    _items: dict[int, _Item] = field(default_factory=dict)  # by the sequence number of its end event

    def settle(self, sim) -> None:
        """After the simulation handled an event: count the busy workers and, if the slowdown
        changes, account every instance's progress at the old one and re-time what runs."""
        now = sim.now
        timed = [i for i, entry in enumerate(sim.heap) if entry[2] in TIMED]
        busy = sum(1 for inst in sim.instances if _computing(inst, now)) + len(timed)
        new = slowdown(busy, self.cores, self.background)
        changed = abs(new - self.factor) > 1e-12
        if changed:
            for inst in sim.instances:
                inst.advance(now)  # progress so far, at the old factor
        self._retime(sim, timed, now, new, changed)
        self.factor = new
        if changed:
            for inst in sim.instances:
                inst.generation += 1  # its pending event is stale
                sim._schedule_instance(inst)

    def _retime(self, sim, timed: list[int], now: float, new: float, changed: bool) -> None:
        live, moved = {}, False
        for i in timed:
            end, seq, kind, payload = sim.heap[i]
            item = self._items.get(seq)
            if item is None:  # it started at this instant, priced in core-seconds
                item = _Item(end - now, now)
            elif changed:
                item.remaining = max(0.0, item.remaining - (now - item.since) / self.factor)
                item.since = now
            else:
                live[seq] = item
                continue
            live[seq] = item
            later = now + item.remaining * new
            if abs(later - end) > 1e-15:
                sim.heap[i] = (later, seq, kind, payload)
                _move_span(sim, kind, payload, end, later)
                moved = True
        if moved:
            heapq.heapify(sim.heap)
        self._items = live


def _computing(inst, now: float) -> bool:
    """An instance decodes, prefills or loads weights (sequences waiting on a tool call do not count,
    nor those of an instance suspended while the learner holds its pool)."""
    return not inst.suspended and (bool(inst.active) or inst.busy_until > now)


def _move_span(sim, kind: str, payload: tuple, old: float, end: float) -> None:
    """The work's trace span (and an executor's busy interval) end when it now ends."""
    track = payload[0].spec.name if kind == "executor" else f"tools[{payload[0]}]"
    if kind == "executor":
        start, _ = payload[0].busy[-1]
        payload[0].busy[-1] = (start, end)
    spans = sim.ledger.spans
    for i in range(len(spans) - 1, -1, -1):
        if spans[i].track == track and spans[i].end == old:
            spans[i] = dataclasses.replace(spans[i], end=end)
            return
