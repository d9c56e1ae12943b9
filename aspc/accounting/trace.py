"""Chrome trace-event files (they open in Perfetto), shared by the simulator and the runtimes:
a process per run, a track per instance or learner, a span per piece of work or bubble.
Contiguous spans of one kind on one track are merged.

Two detail levels (`aspc simulate --trace-detail`): `full` writes every span, a generation
instance's decode segments (useful, tail, padding: hundreds of thousands for a large plan) and a span
per tool call naming its sample; `small` merges each run of contiguous decode segments into one
`decode` span whose name gives the shares, and drops the per-sample detail, so that contiguous tool
calls merge too. Both have the same processes and tracks (Perfetto's rows)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


DETAILS = ("small", "full")
DECODE = ("useful", "padding", "tail")  # a generation instance's segments, labelled by their category


@dataclass(slots=True)  # slots: a simulation records hundreds of thousands
class Span:
    track: str
    start: float
    end: float
    category: str
    label: str
    detail: str = ""  # what only the full trace shows, e.g. a tool call's sample


def coalesce(spans: list[Span]) -> list[Span]:
    by_track: dict[str, list[Span]] = {}
    for span in sorted(spans, key=lambda s: (s.track, s.start)):
        track = by_track.setdefault(span.track, [])
        last = track[-1] if track else None
        if last and (last.category, last.label, last.detail) == (span.category, span.label, span.detail) \
                and span.start - last.end < 1e-9:
            track[-1] = Span(last.track, last.start, max(last.end, span.end), last.category, last.label, last.detail)
        else:
            track.append(span)
    return [s for track in by_track.values() for s in track]


def phases(spans: list[Span]) -> list[Span]:
    """The small trace's spans: each run of contiguous decode segments on a track as one `decode`
    span, no per-sample detail, then coalesced."""
    out: list[Span] = []
    run: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.track, s.start)):
        if run and not _continues(run[-1], span):
            out.append(_decode_span(run))
            run = []
        if _is_decode(span):
            run.append(span)
        else:
            out.append(Span(span.track, span.start, span.end, span.category, span.label))
    if run:
        out.append(_decode_span(run))
    return coalesce(out)


def _is_decode(span: Span) -> bool:
    return span.category in DECODE and span.label == span.category


def _continues(last: Span, span: Span) -> bool:
    return _is_decode(span) and span.track == last.track and span.start - last.end < 1e-9


def _decode_span(run: list[Span]) -> Span:
    """`decode (useful 71%, tail 29%)`, of the category with the most time."""
    seconds = {c: sum(s.end - s.start for s in run if s.category == c) for c in DECODE}
    total = sum(seconds.values()) or 1.0
    shares = ", ".join(f"{c} {100 * v / total:.0f}%" for c, v in seconds.items() if v > 0)
    main = max(seconds, key=seconds.get)
    return Span(run[0].track, run[0].start, run[-1].end, main, f"decode ({shares})" if len(run) > 1 else main)


def trace_events(spans: list[Span], process: str, pid: int, detail: str = "full") -> list[dict]:
    tracks = sorted({s.track for s in spans})
    tid = {t: i for i, t in enumerate(tracks)}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}]
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[t], "args": {"name": t}}
               for t in tracks]
    for s in phases(spans) if detail == "small" else coalesce(spans):
        name = f"{s.label} ({s.detail})" if s.detail else s.label
        events.append({"ph": "X", "name": name, "cat": s.category, "pid": pid, "tid": tid[s.track],
                       "ts": round(s.start * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3),
                       "args": {"bubble": s.category}})
    return events


def write_trace(path: Path, runs: dict[str, list[Span]], detail: str = "full") -> None:
    """One process per run (schedule), a thread per track, at a detail level of DETAILS. Written to
    a temporary file and renamed into place, so an interrupted write never leaves a truncated trace."""
    events = [e for pid, (name, spans) in enumerate(runs.items(), start=1)
              for e in trace_events(spans, name, pid, detail)]
    _write_whole(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _write_whole(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file. A failure (full disk, `ulimit -f`, a read-only
    folder) removes the temporary file and raises OSError naming `path` (a failed write names none)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as error:
        _remove(tmp)
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # e.g. its folder cannot be written either: nothing was left there
        pass


def shifted(spans: list[Span], seconds: float) -> list[Span]:
    """The spans moved later by `seconds` (to follow a phase that came before them)."""
    return [Span(s.track, s.start + seconds, s.end + seconds, s.category, s.label, s.detail) for s in spans]
