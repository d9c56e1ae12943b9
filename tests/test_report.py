"""`aspc report`: the page's sections, the passes' decisions at their lines, summarised timelines,
a measured run, the errors a user can make, a page that loads nothing, and the PNG plot."""
import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest

from aspc.accounting.bubbles import CATEGORIES
from aspc.accounting.trace import Span
from aspc.cli.report import _changes
from aspc.plan.toolchain import compile_with_passes
from aspc.report.decisions import decisions
from aspc.report.timeline import BINS, EXACT_LIMIT, SHOWN, TICKS, timeline_data
from conftest import ROOT

PIPELINE = "pipelines/tiny_grpo_split.aspl"
SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # an XML namespace name, never fetched


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The report of a bundled pipeline, written once for the tests that read it."""
    from click.testing import CliRunner

    from aspc.cli.main import main

    out = tmp_path_factory.mktemp("report") / "r.html"
    result = CliRunner().invoke(main, ["report", str(ROOT / PIPELINE), "-o", str(out), "--steps", "2"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    return out.read_text(encoding="utf-8")


def _timeline(html: str) -> dict:
    text = re.search(r'<script type="application/json" id="timeline-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(text)


def test_page_has_every_section(page):
    for section in ("timelines", "bubbles", "throughput", "source", "graph"):
        assert f'<section id="{section}">' in page
    assert 'id="run"' not in page  # no --run: no measured section
    data = _timeline(page)
    assert [s["name"] for s in data["schedules"]] == ["sync-naive", "sync", "asp"]
    for schedule in data["schedules"]:
        rows = [r["name"] for r in schedule["rows"]]
        assert rows[0] == "gen[0]" and all(r["spans"] for r in schedule["rows"])
    for name in ("sync-naive", "sync", "asp"):
        assert f"<td>{name}</td>" in page  # throughput and bubble tables
        assert f'<svg class="schedule-graph" data-schedule="{name}"' in page


def test_graph_shows_pools_as_clusters_and_parallel_degrees(page):
    asp = re.search(r'<svg class="schedule-graph" data-schedule="asp".*?</svg>', page, re.S).group(0)
    assert "pool rollout: cpu x 1" in asp and "pool learner: cpu x 1" in asp
    assert 'data-stage="gen.channel"' in asp and 'data-stage="update"' in asp
    assert "1 x [tp1 pp1 dp1 ep1]" in asp and "= 1 x cpu" in asp
    assert 'class="edge weights"' in asp


def _line_of(pipeline: str, start: str) -> int:
    lines = (ROOT / pipeline).read_text(encoding="utf-8").splitlines()
    return next(n for n, text in enumerate(lines, start=1) if text.startswith(start))


def _row(page: str, line: int) -> str:
    return re.search(rf'<tr id="L{line}" class="decided">(.*?)</tr>', page, re.S).group(1)


def test_source_lines_carry_the_decisions(page):
    schedule = _row(page, _line_of(PIPELINE, "schedule asp"))
    assert "pass async-decouple: removes the sorting, skewness bubbles" in schedule
    assert "micro-batches of at most 1024 tokens" in _row(page, _line_of(PIPELINE, "stage update"))


def test_decisions_sit_at_the_stage_and_the_schedule_option():
    file = str(ROOT / "pipelines/dapo_32b.aspl")
    compiled = compile_with_passes(file, [], "asp", None, None, False)
    found = decisions(file, _changes(compiled))
    at = {(d.line, d.subject): d.text for d in found}
    line = {start: _line_of("pipelines/dapo_32b.aspl", start) for start in ("stage update", "stage gen", "schedule")}
    assert "padded to 8 shape buckets" in at[(line["stage update"], "update")]
    dispatch = at[(line["stage gen"], "gen.dispatch")]  # a stage a pass inserted: at the stage it serves
    assert "queue_aware dispatch over 8 instances of gen" in dispatch
    assert "pausing in-flight generations" in " ".join(d.text for d in found if d.pass_spec == "partial-rollout")
    assert {d.line for d in found if d.subject == "schedule"} == {line["schedule"]}


def test_a_schedule_the_file_does_not_declare_is_at_no_line():
    file = str(ROOT / "pipelines/dapo_32b.aspl")
    compiled = compile_with_passes(file, [], "sync", None, None, False)
    summaries = [d for d in decisions(file, _changes(compiled)) if d.subject == "schedule"]
    assert summaries and all(d.line == 0 for d in summaries)


@dataclass
class FakeResult:
    schedule: str
    wall_s: float
    spans: list = field(default_factory=list)
    tool_calls: int = 0


def test_few_spans_are_drawn_exactly():
    spans = [Span("gen[0]", i, i + 0.5, "useful", "useful") for i in range(10)]
    data = timeline_data([FakeResult("asp", 10.0, spans)])
    row = data["schedules"][0]["rows"][0]
    assert not data["schedules"][0]["summarised"] and len(row["spans"]) == 10
    assert row["spans"][0] == [0, TICKS // 20, SHOWN.index("useful"), 0]


def test_many_spans_are_summarised_per_bin_and_stay_small():
    n = EXACT_LIMIT + 5000  # alternating short spans, a long one and weight syncs
    short = [Span("gen[0]", i, i + 0.6, "useful" if i % 2 else "tail", "x") for i in range(n)]
    long = [Span("learner", 0, n / 2, "sorting", "idle: samples held back")]
    syncs = [Span("gen[0]", n + k, n + k + 0.01, "sync", "sync") for k in range(3)]
    data = timeline_data([FakeResult("asp", n + 10.0, short + long + syncs)])
    schedule = data["schedules"][0]
    assert schedule["summarised"]
    gen = next(r for r in schedule["rows"] if r["name"] == "gen[0]")["spans"]
    summaries = [s for s in gen if s[3] < 0]
    assert len(gen) <= BINS + 3 and sum(-s[3] for s in summaries) + sum(1 for s in gen if s[3] >= 0) == n + 3
    assert all(abs(sum(p for _, p in s[4]) - 1000) <= 2 for s in summaries)
    assert sum(1 for s in gen if SHOWN[s[2]] == "sync" and s[3] >= 0) == 3  # weight syncs stay exact
    learner = next(r for r in schedule["rows"] if r["name"] == "learner")["spans"]
    assert len(learner) == 1 and learner[0][2] == SHOWN.index("sorting")  # long: exact
    assert data["labels"][learner[0][3]] == "idle: samples held back"
    assert len(json.dumps(data)) < 200_000


class _Loads(HTMLParser):
    """Every attribute of the page that could make a browser load something."""

    def __init__(self):
        super().__init__()
        self.urls, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "poster", "data", "srcset", "background"):
                self.urls.append(value or "")


def test_the_page_loads_nothing_from_the_network(page):
    parser = _Loads()
    parser.feed(page)
    assert parser.urls and all(u.startswith("#") for u in parser.urls), parser.urls  # only in-page anchors
    assert not {"link", "iframe", "img", "object", "embed", "base"} & set(parser.tags)
    assert re.findall(r"https?://[^\s\"'<>)]+", page.replace(SVG_NAMESPACE, "")) == []
    for call in ("fetch(", "XMLHttpRequest", "import(", "WebSocket", "EventSource", "sendBeacon", "@import"):
        assert call not in page
    assert all(target.startswith("#") for target in re.findall(r"url\(([^)]*)\)", page))  # SVG markers
    assert "default-src 'none'" in page  # and the browser is told to refuse any load


def test_measured_run_beside_the_prediction(aspc, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward": 0.1 * s, "staleness_mean": 0.5, "tokens_per_s": 100.0 + s, "samples": 64,
             "wall_s": 2.0 * s, "bubbles": {"useful": 0.5, "sorting": 0.5}} for s in range(1, 4)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew', encoding="utf-8")
    out = tmp_path / "r.html"
    result = aspc("report", PIPELINE, "-o", str(out), "--steps", "1", "--run", str(metrics))
    assert result.exit_code == 0, result.output
    html = out.read_text(encoding="utf-8")
    section = html[html.index('<section id="run">'):]
    assert "<td>measured run</td><td>2.000</td><td>32.00</td><td>0.50</td>" in section  # torn last row skipped
    assert all(title in section for title in ("reward", "staleness (mean version lag)", "tokens/s",
                                              "bubble shares"))


def test_user_errors_are_one_clear_line(aspc, tmp_path):
    empty = tmp_path / "m.jsonl"
    empty.write_text("not json\n", encoding="utf-8")
    result = aspc("report", PIPELINE, "-o", str(tmp_path / "r.html"), "--steps", "1", "--run", str(empty))
    assert result.exit_code == 1 and "no metrics rows" in result.output
    result = aspc("report", PIPELINE, "-o", str(tmp_path / "missing" / "r.html"))
    assert result.exit_code == 1 and "its folder does not exist" in result.output
    result = aspc("report", "pipelines/nope.aspl")
    assert result.exit_code == 1 and "nope.aspl" in result.output and "Traceback" not in result.output


def test_plot_draws_every_schedule_with_the_legend_outside():
    import matplotlib

    matplotlib.use("Agg")
    from aspc.drivers.sim import plot

    @dataclass
    class Result:
        schedule: str
        wall_s: float
        spans: list
        pipeline: str = "p"
        step_time: float = 1.0

        def share(self, category):
            return 1.0 if category == "useful" else 0.0

    a = Result("sync", 10.0, [Span("gen[0]", 0, 2, "useful", "useful"), Span("gen[0]", 2, 6, "sorting", "wait")])
    b = Result("asp", 5.0, [Span("gen[0]", 0, 5, "useful", "useful")])
    fig = plot.plot_figure([a, b])
    timelines, bars = fig.axes[:2], fig.axes[2]
    assert [ax.get_title(loc="left") for ax in timelines] == ["p: sync (1.0 s/step)", "p: asp (1.0 s/step)"]
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)  # the legend is the figure's
    names = {t.get_text() for t in timelines[0].texts}
    assert names == {"sorting", plot.NO_WORK}  # the bubble and the 4 s with no work are named
    assert timelines[0].get_xlim() == timelines[1].get_xlim() == (0.0, 10.0)
    assert len(bars.patches) == len(CATEGORIES) * 2  # (write_plot saves it: tests/test_simulator.py)
    matplotlib.pyplot.close(fig)
