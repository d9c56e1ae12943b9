"""Pictures of simulations: a timeline per schedule on one time axis (a row per instance /
learner) and a stacked bar chart of the bubble breakdown. The legend sits below the tracks; time
a device track recorded no work for is hatched, and wide gaps and bubbles carry their names."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from aspc.accounting.bubbles import COLORS, gaps
from aspc.accounting.ledger import CATEGORIES
from aspc.accounting.trace import coalesce

NO_WORK = "no work recorded"  # idle devices, or a time-shared pool serving its other role
LABELLED = 0.06  # a gap or bubble at least this share of the axis is named on the picture


def write_plot(path: Path, results: list) -> None:
    """Every result's timeline, stacked on one time axis, and the bubble breakdown of all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_figure(results: list):
    """The figure write_plot saves: a timeline per result, the bars, the legend below."""
    import matplotlib.pyplot as plt

    rows = [_rows(r) for r in results]
    heights = [max(1, len(tracks)) for tracks, _ in rows]
    fig = plt.figure(figsize=(16, 1.6 + 0.3 * sum(heights) + 0.5 * len(results)))
    grid = fig.add_gridspec(len(results), 2, width_ratios=[3, 1], height_ratios=heights)
    axis_end = max(r.wall_s for r in results)
    first = None
    for i, (result, (tracks, spans)) in enumerate(zip(results, rows)):
        timeline = fig.add_subplot(grid[i, 0], sharex=first)
        first = first or timeline
        _draw_timeline(timeline, result, tracks, spans, axis_end)
        timeline.tick_params(labelbottom=i == len(results) - 1)
    assert first is not None, "a figure of no results"
    first.set_xlim(0, axis_end)
    fig.axes[-1].set_xlabel("seconds")
    _draw_bars(fig.add_subplot(grid[:, 1]), results)
    fig.legend(handles=_legend(any("tools" in tracks for tracks, _ in rows)), loc="lower center",
               ncols=11, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.9 / fig.get_figheight(), 1, 1))
    return fig


def _rows(result) -> tuple[list[str], list]:
    spans = coalesce(result.spans)
    row_of = {s.track: "tools" if s.category == "tool" else s.track for s in spans}  # one row for every runner
    spans = [dataclasses.replace(s, track=row_of[s.track]) for s in spans]
    return sorted({s.track for s in spans}), spans


def _draw_timeline(ax, result, tracks: list[str], spans: list, axis_end: float) -> None:
    for row, track in enumerate(tracks):
        mine = [s for s in spans if s.track == track]
        if track != "tools" and not track.endswith(" switch"):  # runners and pool switches are no device track
            for a, b in gaps([(s.start, s.end) for s in mine], 0.0, result.wall_s):
                ax.broken_barh([(a, b - a)], (row - 0.4, 0.8), facecolors="white", edgecolors="#bdbdbd",
                               hatch="///", linewidth=0)
                _name(ax, a, b, row, NO_WORK, axis_end)
        for category in CATEGORIES + ("tool",):
            boxes = [(s.start, s.end - s.start) for s in mine if s.category == category]
            if boxes:
                ax.broken_barh(boxes, (row - 0.4, 0.8), facecolors=COLORS[category], linewidth=0)
        for s in mine:
            if s.category not in ("useful", "tool"):
                _name(ax, s.start, s.end, row, s.category, axis_end)
    ax.set_yticks(range(len(tracks)), tracks, fontsize=8)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_title(f"{result.pipeline}: {result.schedule} ({result.step_time:.1f} s/step)", fontsize=10, loc="left")


def _name(ax, start: float, end: float, row: int, text: str, axis_end: float) -> None:
    if end - start >= LABELLED * axis_end:
        ax.text((start + end) / 2, row, text, ha="center", va="center", fontsize=7, clip_on=True)


def _draw_bars(bars, results: list) -> None:
    bottom = [0.0] * len(results)
    for category in CATEGORIES:
        shares = [100 * r.share(category) for r in results]
        bars.bar([r.schedule for r in results], shares, bottom=bottom, color=COLORS[category])
        bottom = [b + s for b, s in zip(bottom, shares)]
    bars.set_ylabel("% of device-time")
    bars.set_title("bubble breakdown", fontsize=10)


def _legend(with_tools: bool) -> list:
    from matplotlib.patches import Patch

    shown = CATEGORIES + (("tool",) if with_tools else ())  # tool runners' calls, agentic plans only
    return [Patch(color=COLORS[c], label=c) for c in shown] + \
        [Patch(facecolor="white", edgecolor="#bdbdbd", hatch="///", label=NO_WORK)]
