"""Dispatch policies: which generation instance gets a released unit (a prompt's group, or one
sample), and whether an idle instance may steal queued work. Pure functions over queue summaries."""
from __future__ import annotations

from typing import NamedTuple


class Load(NamedTuple):  # one per instance for every unit routed: a named tuple, as Request
    """What the controller knows of one instance when it routes work."""

    instance: int  # not `index`: that would shadow tuple.index
    live: bool
    queued_requests: int
    inflight_requests: int
    queued_work: float  # predicted tokens waiting in its queue
    inflight_work: float  # predicted tokens still to generate for what it runs


def choose_instance(policy: str, loads: list[Load], counter: int) -> int:
    """The instance a new unit goes to."""
    live = [l for l in loads if l.live] or loads
    if policy == "queue_aware":
        return min(live, key=lambda l: (l.queued_work + l.inflight_work, l.instance)).instance
    if policy == "least_requests":
        return min(live, key=lambda l: (l.queued_requests + l.inflight_requests, l.instance)).instance
    return live[counter % len(live)].instance  # round_robin, and the static split of sync-naive


def steals(policy: str) -> bool:
    """Only queue-aware dispatch moves queued work to an idle instance; the others route once."""
    return policy == "queue_aware"
