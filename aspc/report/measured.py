"""A measured run beside the prediction: its metrics.jsonl rows (written by `aspc run`) as small
charts over steps, and its step time, samples/s and staleness next to each simulated schedule's."""
from __future__ import annotations

from html import escape

from aspc.report.model import Result
from aspc.report.tables import COLORS, table

CHARTS = (("reward", "reward"), ("staleness_mean", "staleness (mean version lag)"), ("tokens_per_s", "tokens/s"),
          ("response_len", "mean response length"))
W, H, M = 280, 120, 28


def measured_section(file: str, rows: list[dict], results: list[Result]) -> str:
    steps = [r for r in rows if isinstance(r.get("step"), int)]
    charts = [_chart(title, [(r["step"], r[key]) for r in steps if _number(r.get(key))]) for key, title in CHARTS]
    charts.append(_bubble_chart(steps))
    note = ('<p class="note">The metrics file does not say which schedule the run used: compare it with that '
            "schedule's row. Predicted times are the simulator's for this file's cluster; a run on another "
            "machine (the CPU backend) is not expected to match them.</p>")
    return (f'<p>Run: <code>{escape(file)}</code>, {len(steps)} steps.</p>' + _comparison(steps, results) + note
            + '<div class="charts">' + "".join(c for c in charts if c) + "</div>")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _comparison(steps: list[dict], results: list[Result]) -> str:
    head = ["", "step time (s)", "samples/s", "mean staleness"]
    rows = [[f"predicted: {r.schedule}", f"{r.step_time:.3f}", f"{r.samples_per_s:.2f}", f"{_mean_lag(r):.2f}"]
            for r in results]
    wall = max((r["wall_s"] for r in steps if _number(r.get("wall_s"))), default=0.0)
    samples = sum(r["samples"] for r in steps if _number(r.get("samples")))
    lags = [r["staleness_mean"] for r in steps if _number(r.get("staleness_mean"))]
    rows.append(["measured run", f"{wall / len(steps):.3f}" if steps and wall else "-",
                 f"{samples / wall:.2f}" if wall and samples else "-",
                 f"{sum(lags) / len(lags):.2f}" if lags else "-"])
    return table("measured", head, rows)


def _mean_lag(r: Result) -> float:
    total = sum(r.staleness.values())
    return sum(k * v for k, v in r.staleness.items()) / total if total else 0.0


def _chart(title: str, points: list[tuple[float, float]], color: str = "#1565c0") -> str:
    if not points:
        return ""
    return _frame(title, points, [(color, points)])


def _bubble_chart(steps: list[dict]) -> str:
    """Per-step bubble shares, when the rows carry them (a "bubbles" object of category -> share)."""
    series = {}
    for row in steps:
        for category, share in (row.get("bubbles") or {}).items():
            if category in COLORS and _number(share):
                series.setdefault(category, []).append((row["step"], share))
    if not series:
        return ('<div class="chart empty">bubble shares over steps: this metrics file has none per step '
                "(aspc run writes each row's \"bubbles\"; this file has none: an older run?)</div>")
    points = [p for line in series.values() for p in line]
    return _frame("bubble shares", points, [(COLORS[c], line) for c, line in series.items()])


def _frame(title: str, points, lines) -> str:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)

    def at(x, y):
        px = M + (x - x0) / ((x1 - x0) or 1) * (W - 2 * M)
        py = H - M + -(y - y0) / ((y1 - y0) or 1) * (H - 2 * M)
        return f"{px:.1f},{py:.1f}"

    polylines = "".join(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" '
                        f'points="{" ".join(at(x, y) for x, y in line)}"/>' for c, line in lines)
    return (f'<figure class="chart"><figcaption>{escape(title)}</figcaption>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">'
            f'<rect x="{M}" y="{M}" width="{W - 2 * M}" height="{H - 2 * M}" class="plot"/>{polylines}'
            f'<text x="{M}" y="{H - 8}">step {x0:g}</text><text x="{W - M}" y="{H - 8}" text-anchor="end">{x1:g}</text>'
            f'<text x="2" y="{M + 4}">{y1:.3g}</text><text x="2" y="{H - M}">{y0:.3g}</text></svg></figure>')
