"""What the page is built from: the CLI compiles, simulates and reads files, and hands these over."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aspc.accounting.trace import Span
from aspc.ir.graph import StageGraph


class Result(Protocol):
    """A simulation's result, as the page reads it (aspc/drivers/sim/result.py SimResult)."""

    schedule: str
    steps: int
    devices: int
    wall_s: float
    samples_per_step: int
    bubbles: dict[str, float]
    staleness: dict[int, int]
    spans: list[Span]
    pools: dict[str, tuple[int, float]]
    tool_calls: int

    @property
    def step_time(self) -> float: ...

    @property
    def e2e_tps(self) -> float: ...

    @property
    def samples_per_s(self) -> float: ...

    @property
    def bound_step_time(self) -> float: ...

    @property
    def efficiency(self) -> float: ...

    def share(self, category: str) -> float: ...

    def pool_utilization(self, pool: str) -> float: ...


@dataclass(frozen=True)
class PassChange:
    """One pass of a schedule's pipeline and the graph before and after it."""

    spec: str  # as written in a pipeline: `pack{tokens=32768,buckets=8}`
    name: str  # `pack`
    bubble: str  # the bubble it removes ("" if none)
    before: StageGraph
    after: StageGraph


@dataclass(frozen=True)
class CompiledSchedule:
    """One schedule of the file: its pass pipeline, the final graph and its simulation."""

    graph: StageGraph
    passes: list[PassChange]
    result: Result


@dataclass(frozen=True)
class ReportInput:
    file: str
    source: str
    schedules: list[CompiledSchedule]  # sync-naive, sync, asp: a timeline each
    baselines: list[Result] = field(default_factory=list)  # sync@colocated: in the tables only
    baseline_note: str = ""  # why sync@colocated is missing, if it is
    run_file: str = ""
    run_rows: list[dict] = field(default_factory=list)  # a measured run's metrics.jsonl rows
    run_schedule: str = ""  # the schedule the run used ("" if nothing says)
    run_schedule_from: str = ""  # what says so: "its metrics rows", "its folder name ...", "--run-schedule"
