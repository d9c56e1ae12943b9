"""Schedules are named pass pipelines. `place` runs early, so that the passes after it know
which stages time-share devices with generation.

  sync-naive  static batches, pad to longest, an even static split, stage barriers
  sync        what a well-run synchronous framework does today: continuous batching inside an
              instance, remove-padding (packing, dynamic shapes), even split, stage barriers
  asp         the Adaptive Scheduling Pipeline: sync plus asynchronous decoupling under a
              staleness bound, queue-aware dispatch, packing into static shape buckets,
              streaming, and (if asked) partial rollout
With `placement = auto` every schedule starts with `auto-place`: each at its own best layout.
"""
from __future__ import annotations

from aspc.frontend import schema
from aspc.ir.graph import ScheduleSpec, StageGraph

SCHEDULES = ("asp", "sync", "sync-naive")


def schedule_for(graph: StageGraph, kind: str | None) -> ScheduleSpec:
    """The file's schedule, or `kind` with its defaults when another one is asked for."""
    if kind is None or kind == graph.schedule.kind:
        return graph.schedule
    defaults = {name: spec.default for name, spec in schema.SCHEDULES[kind].items()
                if name not in schema.SEARCH_BOUNDS}  # not given: nothing searched (left out, as the front end does)
    if graph.schedule.option("placement") == "auto":  # every schedule at its own layout (auto-place)
        defaults["placement"] = "auto"
        if graph.schedule.option("max_pack") is not None:  # and its own micro-batch budget
            defaults["max_pack"] = graph.schedule.option("max_pack")
    return ScheduleSpec(kind, tuple(sorted(defaults.items())))


def pipeline_for(schedule: ScheduleSpec) -> str:
    auto = "auto-place," if schedule.option("placement") == "auto" else ""
    return auto + _pipeline(schedule)


def _pipeline(schedule: ScheduleSpec) -> str:
    if schedule.kind == "sync-naive":
        return "place"
    if schedule.kind == "sync":
        return ("continuous-batching,place,queue-aware-dispatch{policy=round_robin},"
                f"pack{{tokens={schedule.option('pack') or 0},buckets=0}}")  # pack: auto-place's budget
    o = schedule.option
    passes = ["continuous-batching", "place", f"async-decouple{{staleness={o('staleness')}}}",
              f"queue-aware-dispatch{{policy={o('dispatch')}}}", f"stream{{micro={o('stream')}}}",
              f"pack{{tokens={o('pack') or 0},buckets={o('buckets')}}}"]
    if o("partial_rollout"):
        passes.append(f"partial-rollout{{max_split={o('partial_rollout')}}}")
    return ",".join(passes)
