"""A measured run beside the prediction: its metrics.jsonl rows (written by `aspc run`) as charts
over steps, and its step time, samples/s and staleness next to the prediction of the schedule the
run used (every schedule's, when the run does not say which)."""
from __future__ import annotations

from html import escape

from aspc.report.charts import line_chart
from aspc.report.model import ReportInput, Result
from aspc.report.tables import COLORS, table

CHARTS = (("reward", "reward", "mean reward"), ("staleness_mean", "staleness", "mean version lag (steps)"),
          ("tokens_per_s", "throughput", "tokens/s"), ("response_len", "mean response length", "tokens"),
          # the engine's log-probs against the trainer's, on tokens of the weights being trained (aspc/rl/mismatch.py)
          ("mismatch_abs", "training-inference mismatch", "mean |log-prob difference| per token"),
          ("mismatch_kl", "training-inference KL", "KL(engine || trainer) per token"))
COLOR = "#1565c0"


def measured_section(report: ReportInput, results: list[Result]) -> str:
    steps = [r for r in report.run_rows if isinstance(r.get("step"), int)]
    charts = [_chart(title, y_title, [(r["step"], r[key]) for r in steps if _number(r.get(key))])
              for key, title, y_title in CHARTS]
    charts.append(_bubble_chart(steps))
    predicted = [r for r in results if r.schedule == report.run_schedule] or results
    return (f'<p>Run: <code>{escape(report.run_file)}</code>, {len(steps)} steps.</p>'
            + _comparison(steps, predicted) + _note(report)
            + '<div class="charts">' + "".join(c for c in charts if c) + "</div>")


def _note(report: ReportInput) -> str:
    cluster = ("Predicted times are the simulator's for this file's cluster; a run on another machine (the "
               "CPU backend) is not expected to match them.")
    if not report.run_schedule:
        which = ("Neither the metrics rows nor the run's folder (runs/PIPELINE-SCHEDULE/) say which schedule "
                 "the run used, so every schedule's prediction is shown: give <code>--run-schedule</code>.")
    else:
        which = (f"The run used schedule <b>{escape(report.run_schedule)}</b> ({escape(report.run_schedule_from)}): "
                 "it is compared with that schedule's prediction.")
    return f'<p class="note">{which} {cluster}</p>'


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _comparison(steps: list[dict], results: list[Result]) -> str:
    head = ["", "step time (s)", "samples/s", "mean staleness"]
    rows = [[f"predicted: {r.schedule}", f"{r.step_time:.3f}", f"{r.samples_per_s:.2f}", f"{_mean_lag(r):.2f}"]
            for r in results]
    measured = _measured(steps)
    rows.append(["measured run", *[f"{v:.{d}f}" if v is not None else "-" for v, d in zip(measured, (3, 2, 2))]])
    if len(results) == 1:
        rows.append(["measured / predicted", *_ratios(measured, results[0])])
    return table("measured", head, rows)


def _measured(steps: list[dict]) -> tuple[float | None, float | None, float | None]:
    """The run's step time, samples/s and mean staleness (None: its rows do not say)."""
    wall = max((r["wall_s"] for r in steps if _number(r.get("wall_s"))), default=0.0)
    samples = sum(r["samples"] for r in steps if _number(r.get("samples")))
    lags = [r["staleness_mean"] for r in steps if _number(r.get("staleness_mean"))]
    return (wall / len(steps) if steps and wall else None, samples / wall if wall and samples else None,
            sum(lags) / len(lags) if lags else None)


def _ratios(measured, predicted: Result) -> list[str]:
    pairs = zip(measured, (predicted.step_time, predicted.samples_per_s, _mean_lag(predicted)))
    return [f"{m / p:.2f}x" if m is not None and p else "-" for m, p in pairs]


def _mean_lag(r: Result) -> float:
    total = sum(r.staleness.values())
    return sum(k * v for k, v in r.staleness.items()) / total if total else 0.0


def _chart(title: str, y_title: str, points: list[tuple[float, float]]) -> str:
    if not points:
        return ""
    return line_chart(title, y_title, [(COLOR, title, points)])


def _bubble_chart(steps: list[dict]) -> str:
    """Per-step bubble shares, when the rows carry them (a "bubbles" object of category -> share)."""
    series: dict[str, list] = {}
    for row in steps:
        for category, share in (row.get("bubbles") or {}).items():
            if category in COLORS and _number(share):
                series.setdefault(category, []).append((row["step"], share))
    if not series:
        return ('<div class="chart empty">bubble shares over steps: this metrics file has none per step '
                "(aspc run writes each row's \"bubbles\"; this file has none: an older run?)</div>")
    return line_chart("bubble shares", "share of device-time", [(COLORS[c], c, line) for c, line in series.items()])
