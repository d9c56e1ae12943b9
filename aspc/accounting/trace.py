"""Chrome trace-event files (they open in Perfetto), shared by the simulator and the runtimes:
a process per run, a track per instance or learner, a span per piece of work or bubble.
Contiguous spans of one kind on one track are merged."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)  # slots: a simulation records hundreds of thousands
class Span:
    track: str
    start: float
    end: float
    category: str
    label: str


def coalesce(spans: list[Span]) -> list[Span]:
    by_track: dict[str, list[Span]] = {}
    for span in sorted(spans, key=lambda s: (s.track, s.start)):
        track = by_track.setdefault(span.track, [])
        last = track[-1] if track else None
        if last and last.category == span.category and last.label == span.label and span.start - last.end < 1e-9:
            track[-1] = Span(last.track, last.start, max(last.end, span.end), last.category, last.label)
        else:
            track.append(span)
    return [s for track in by_track.values() for s in track]


def trace_events(spans: list[Span], process: str, pid: int) -> list[dict]:
    tracks = sorted({s.track for s in spans})
    tid = {t: i for i, t in enumerate(tracks)}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}]
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[t], "args": {"name": t}}
               for t in tracks]
    for s in coalesce(spans):
        events.append({"ph": "X", "name": s.label, "cat": s.category, "pid": pid, "tid": tid[s.track],
                       "ts": round(s.start * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3),
                       "args": {"bubble": s.category}})
    return events


def write_trace(path: Path, runs: dict[str, list[Span]]) -> None:
    """One process per run (schedule), a thread per track. Written to a temporary file and renamed
    into place, so an interrupted write never leaves a truncated trace."""
    events = [e for pid, (name, spans) in enumerate(runs.items(), start=1)
              for e in trace_events(spans, name, pid)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")
    os.replace(tmp, path)


def shifted(spans: list[Span], seconds: float) -> list[Span]:
    """The spans moved later by `seconds` (to follow a phase that came before them)."""
    return [Span(s.track, s.start + seconds, s.end + seconds, s.category, s.label) for s in spans]
