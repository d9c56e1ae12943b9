"""The page's tables: predicted throughput, the bubble breakdown per schedule, and a measured run."""
from __future__ import annotations

from html import escape

from aspc.accounting.bubbles import CATEGORIES, COLORS
from aspc.report.model import Result

BASES = ("sync", "sync@colocated", "sync-naive")


def throughput_table(results: list[Result]) -> str:
    """One row per schedule; "vs X" is the row's e2e_tps over X's."""
    by = {r.schedule: r for r in results}
    head = ["schedule", "step time (s)", "bubble-free bound (s)", "efficiency", "e2e_tps (tokens/s/device)",
            "samples/s", *[f"vs {b}" for b in BASES], "staleness (version lag: samples)", "pool utilisation"]
    rows = [[r.schedule, f"{r.step_time:.2f}", f"{r.bound_step_time:.2f}", f"{100 * r.efficiency:.1f}%",
             f"{r.e2e_tps:.1f}", f"{r.samples_per_s:.2f}",
             *[f"{r.e2e_tps / by[b].e2e_tps:.2f}x" if b in by else "-" for b in BASES],
             ", ".join(f"{k}: {v}" for k, v in r.staleness.items()) or "-", _pools(r)] for r in results]
    return table("throughput", head, rows)


def _pools(r: Result) -> str:
    return ", ".join(f"{pool} {100 * r.pool_utilization(pool):.0f}%" for pool in r.pools)


def shown_categories(results: list[Result]) -> tuple[str, ...]:
    """tool_wait only for agentic plans, as the text reports do."""
    agentic = any(r.tool_calls or r.bubbles.get("tool_wait") for r in results)
    return tuple(c for c in CATEGORIES if c != "tool_wait" or agentic)


def bubble_breakdown(results: list[Result]) -> str:
    """A stacked bar and the shares of every category, per schedule."""
    categories = shown_categories(results)
    bars = "".join(f'<div class="bar-row"><span class="bar-name">{escape(r.schedule)}</span><div class="bar">'
                   + "".join(_segment(c, r.share(c)) for c in categories) + "</div></div>" for r in results)
    rows = [[r.schedule, *[f"{100 * r.share(c):.1f}%" for c in categories]] for r in results]
    return bars + table("bubbles", ["schedule", *categories], rows)


def _segment(category: str, share: float) -> str:
    return (f'<span class="seg" style="width:{100 * share:.2f}%;background:{COLORS[category]}" '
            f'title="{category} {100 * share:.1f}%"></span>')


def legend(categories) -> str:
    return "".join(f'<span class="key"><span class="swatch" style="background:{COLORS[c]}"></span>{c}</span>'
                   for c in categories)


def table(name: str, head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{name}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'
