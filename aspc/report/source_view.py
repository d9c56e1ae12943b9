"""The program's source with the passes' decisions beside the lines they concern, for each schedule
(the page shows one schedule's at a time)."""
from __future__ import annotations

from collections import defaultdict
from html import escape

from aspc.report.decisions import Decision


def source_html(source: str, decided: dict[str, list[Decision]]) -> str:
    at: dict[int, list[str]] = defaultdict(list)
    for schedule, decisions in decided.items():
        for d in decisions:
            at[d.line].append(_note(schedule, d))
    rows = []
    for number, text in enumerate(source.splitlines(), start=1):  # line 0: _unplaced
        mark = ' class="decided"' if at.get(number) else ""
        rows.append(f'<tr id="L{number}"{mark}><td class="ln">{number}</td><td class="code"><code>{escape(text)}'
                    f'</code></td><td class="notes">{"".join(at.get(number, []))}</td></tr>')
    return _unplaced(decided) + f'<table class="source"><tbody>{"".join(rows)}</tbody></table>'


def _unplaced(decided: dict[str, list[Decision]]) -> str:
    """Per schedule, the decisions at no line: a schedule the file does not declare, or --set."""
    out = []
    for schedule, decisions in decided.items():
        notes = "".join(_note(schedule, d) for d in decisions if d.line == 0)
        if notes:
            out.append(f'<div class="unplaced" data-schedule="{escape(schedule)}"><p>Not at a line of the file '
                       f"(schedule {escape(schedule)} is not the file's schedule block, or an option came from "
                       f"--set):</p>{notes}</div>")
    return "".join(out)


def _note(schedule: str, d: Decision) -> str:
    kind = "pass" if d.subject == "schedule" else "decision"
    return (f'<div class="note {kind}" data-schedule="{escape(schedule)}"><span class="by">{escape(d.pass_spec)}'
            f"</span> {escape(d.text)}</div>")
