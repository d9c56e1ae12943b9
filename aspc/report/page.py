"""The report page: the template (page.html, page.css, page.js, shipped as package data) with every
section filled in, written as one file that loads nothing at view time (its Content-Security-Policy
forbids it)."""
from __future__ import annotations

import json
import re
from html import escape
from importlib.resources import files

from aspc.report.decisions import decisions
from aspc.report.graph_svg import graph_svg
from aspc.report.measured import measured_section
from aspc.report.model import ReportInput
from aspc.report.source_view import source_html
from aspc.report.tables import COLORS, bubble_breakdown, legend, shown_categories, throughput_table
from aspc.report.timeline import BINS, EXACT_LIMIT, timeline_data

SHOWN_FIRST = "asp"  # the schedule whose decisions and graph the page opens with


def build_page(report: ReportInput) -> str:
    results = [s.result for s in report.schedules]
    table_results = results[:-1] + report.baselines + results[-1:]  # sync@colocated beside sync, before asp
    graph = report.schedules[-1].graph
    names = [s.result.schedule for s in report.schedules]
    timelines = timeline_data(results)
    slots = {
        "title": escape(f"{graph.pipeline}: schedules, bubbles and decisions"),
        "meta": escape(_meta(report)),
        "shown": escape(SHOWN_FIRST if SHOWN_FIRST in names else names[-1]),
        "run_link": '<a href="#run">measured run</a>' if report.run_file else "",
        "legend": legend(shown_categories(results) + _tool_key(results)) + _hatched_key(),
        "summary_note": escape(_summary_note(timelines)),
        "bubbles": bubble_breakdown(table_results),
        "throughput": throughput_table(table_results),
        "baseline_note": escape(report.baseline_note),
        "steps_note": _steps_note(report),
        "picker": _picker(names),
        "source": source_html(report.source, {s.result.schedule: decisions(report.file, s.passes)
                                              for s in report.schedules}),
        "graphs": "".join(graph_svg(s.graph, s.result.schedule) for s in report.schedules),
        "run_section": _run_section(report, results),
        "data": _script_json(timelines | {"colors": COLORS}),
        "css": _asset("page.css"),
        "js": _asset("page.js"),
    }
    return re.sub(r"\{\{(\w+)\}\}", lambda m: slots[m.group(1)], _asset("page.html"))


def _asset(name: str) -> str:
    return files("aspc.report").joinpath(name).read_text(encoding="utf-8")


def _meta(report: ReportInput) -> str:
    r = report.schedules[-1].result
    return (f"{report.file}: {r.devices} devices, {r.steps} simulated steps of {r.samples_per_step} samples "
            f"per schedule (aspc report, the simulator's prediction)")


def _steps_note(report: ReportInput) -> str:
    """HTML: why `aspc simulate` prints the same speed-ups, or others."""
    steps = int(report.schedules[-1].result.steps)
    return (f"Over {steps} simulated steps per schedule: <code>aspc simulate FILE --compare --steps {steps}</code> "
            "prints the same speed-ups (a schedule's first steps fill its pipeline, so other step counts give "
            "other figures).")


def _summary_note(timelines: dict) -> str:
    summarised = [s["name"] for s in timelines["schedules"] if s["summarised"]]
    if not summarised:
        return "Every span is drawn as simulated."
    return (f"{', '.join(summarised)}: more than {EXACT_LIMIT} spans, so spans shorter than 1/{BINS} of their "
            "schedule's length "
            "are summarised per bin (stacked by each category's share; hover for the shares); weight syncs "
            "and longer spans are exact.")


def _tool_key(results) -> tuple[str, ...]:
    """The tools row's colour, for plans with an environment's tool calls only."""
    return ("tool",) if any(r.tool_calls for r in results) else ()


def _hatched_key() -> str:
    return '<span class="key"><span class="swatch hatched"></span>no work recorded</span>'


def _picker(names: list[str]) -> str:
    shown = SHOWN_FIRST if SHOWN_FIRST in names else names[-1]
    return "".join(f'<label><input type="radio" name="pick" value="{escape(n)}"'
                   f'{" checked" if n == shown else ""}> {escape(n)}</label>' for n in names)


def _run_section(report: ReportInput, results) -> str:
    if not report.run_file:
        return ""
    body = measured_section(report, results)
    return f'<section id="run"><h2>Measured run beside the prediction</h2>{body}</section>'


def _script_json(value) -> str:
    """JSON that cannot end its <script> element early."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")
