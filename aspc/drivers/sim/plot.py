"""Pictures of a simulation: a timeline per track and a stacked bar chart of the bubble breakdown."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from aspc.accounting.ledger import CATEGORIES
from aspc.accounting.trace import coalesce

COLORS = {"useful": "#2e7d32", "padding": "#f9a825", "tail": "#ff8a65", "skewness": "#c62828", "sorting": "#6a1b9a",
          "sync": "#1565c0", "idle": "#bdbdbd", "tool_wait": "#ef6c00", "tool": "#8d6e63"}


def write_plot(path: Path, results: list, timeline_of) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1]})
    spans = coalesce(timeline_of.spans)
    row_of = {s.track: "tools" if s.category == "tool" else s.track for s in spans}  # one row for every runner
    spans = [dataclasses.replace(s, track=row_of[s.track]) for s in spans]
    tracks = sorted({s.track for s in spans})
    for row, track in enumerate(tracks):
        for category in CATEGORIES + ("tool",):
            boxes = [(s.start, s.end - s.start) for s in spans if s.track == track and s.category == category]
            if boxes:
                timeline.broken_barh(boxes, (row - 0.4, 0.8), facecolors=COLORS[category], linewidth=0)
    timeline.set_yticks(range(len(tracks)), tracks)
    timeline.set_xlabel("seconds")
    timeline.set_title(f"{timeline_of.pipeline} — {timeline_of.schedule}: timeline per instance / learner")
    bottom = [0.0] * len(results)
    for category in CATEGORIES:
        shares = [100 * r.share(category) for r in results]
        bars.bar([r.schedule for r in results], shares, bottom=bottom, color=COLORS[category], label=category)
        bottom = [b + s for b, s in zip(bottom, shares)]
    bars.set_ylabel("% of device-time")
    bars.set_title("bubble breakdown")
    shown = CATEGORIES + (("tool",) if "tools" in tracks else ())  # tool runners' calls, agentic plans only
    timeline.legend(handles=[Patch(color=COLORS[c], label=c) for c in shown], loc="upper right",
                    fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
