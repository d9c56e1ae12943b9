"""`aspc report`: the page's sections, the passes' decisions at their lines, summarised timelines,
a schedule graph whose view box holds all it draws, a measured run beside its own schedule's
prediction, speed-ups that agree with `aspc simulate`, the errors a user can make, a page that
loads nothing, and the PNG plot."""
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest

from aspc.accounting.bubbles import CATEGORIES
from aspc.accounting.trace import Span
from aspc.cli.report import _changes
from aspc.cli.toolchain import compile_with_passes
from aspc.report.decisions import decisions
from aspc.report.graph_svg import graph_svg
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


def test_a_short_schedule_is_summarised_at_its_own_length():
    """Fitted to the width, a schedule a tenth as long as the longest keeps BINS bins, not BINS/10."""
    n = EXACT_LIMIT + 5000
    short = [Span("gen[0]", i, i + 0.4, "useful", "x") for i in range(n)]
    data = timeline_data([FakeResult("sync-naive", 10.0 * n, [Span("gen[0]", 0, 10.0 * n, "useful", "x")]),
                          FakeResult("asp", float(n), short)])
    gen = data["schedules"][1]["rows"][0]["spans"]
    assert BINS - 2 <= sum(1 for s in gen if s[3] < 0) <= BINS + 1


def _tspan_lines(node: ET.Element) -> list[tuple[float, float, str, bool]]:
    """(x, baseline, text, bold) of each line of a stage's text: each tspan moves down by its dy."""
    text = node.find(f"{{{SVG_NAMESPACE}}}text")
    y, out = float(text.get("y")), []
    for line in text:
        y += float(line.get("dy"))
        out.append((float(line.get("x")), y, line.text or "", line.get("class") == "name"))
    return out


def _drawn_boxes(svg: ET.Element):
    """Every node's rectangle and text lines, measured at 0.62 em a character (0.68 em bold)."""
    for node in svg.iter(f"{{{SVG_NAMESPACE}}}g"):
        if node.get("class") != "node":
            continue
        rect = node.find(f"{{{SVG_NAMESPACE}}}rect")
        x, y, w, h = (float(rect.get(k)) for k in ("x", "y", "width", "height"))
        yield node.get("data-stage"), (x, y, x + w, y + h)
        for left, baseline, text, bold in _tspan_lines(node):
            right = left + len(text) * 11 * (0.68 if bold else 0.62)
            yield node.get("data-stage"), (left, baseline - 11, right, baseline)


def test_the_graph_view_box_holds_every_node_and_its_text(tmp_path):
    """The right-most stage, with a long name, is inside the picture, as is everything else."""
    source = (ROOT / PIPELINE).read_text(encoding="utf-8")
    source = source.replace("stage update", "stage update_the_actor_policy_weights")
    file = tmp_path / "long_name.aspl"
    file.write_text(source, encoding="utf-8")
    compiled = compile_with_passes(str(file), [], "asp", None, None, False)
    svg = ET.fromstring(graph_svg(compiled.graph, "asp"))
    left, top, width, height = map(float, svg.get("viewBox").split())
    assert (float(svg.get("width")), float(svg.get("height"))) == (width, height)
    boxes = list(_drawn_boxes(svg))
    assert "update_the_actor_policy_weights" in {stage for stage, _ in boxes}
    for stage, (x0, y0, x1, y1) in boxes:
        assert left <= x0 and x1 <= left + width and top <= y0 and y1 <= top + height, (stage, x1, left + width)
    bands = [b.find(f"{{{SVG_NAMESPACE}}}rect") for b in svg.iter(f"{{{SVG_NAMESPACE}}}g") if b.get("class") == "pool"]
    right = max(x1 for _, (_, _, x1, _) in boxes)
    assert all(float(r.get("x")) + float(r.get("width")) >= right for r in bands)  # a band holds every column


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


def _metrics(folder, extra: dict | None = None):
    """A metrics.jsonl as `aspc run` writes it (and a torn last line), in runs/FOLDER/."""
    rows = [{"step": s, "reward": 0.1 * s, "staleness_mean": 0.5, "tokens_per_s": 100.0 + s, "samples": 64,
             "wall_s": 2.0 * s, "bubbles": {"useful": 0.5, "sorting": 0.5}, **(extra or {})} for s in range(1, 4)]
    folder.mkdir(parents=True)
    path = folder / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew', encoding="utf-8")
    return path


def _run_section(aspc, tmp_path, metrics, *more) -> str:
    out = tmp_path / "r.html"
    result = aspc("report", PIPELINE, "-o", str(out), "--steps", "1", "--run", str(metrics), *more)
    assert result.exit_code == 0, result.output
    html = out.read_text(encoding="utf-8")
    return html[html.index('<section id="run">'):]


def _predicted(section: str) -> list[str]:
    return re.findall(r"<td>predicted: ([\w-]+)</td>", section)


def test_measured_run_beside_the_prediction_of_its_schedule(aspc, tmp_path):
    """runs/PIPELINE-SCHEDULE/ (the folder `aspc run` writes) says which schedule the run used."""
    section = _run_section(aspc, tmp_path, _metrics(tmp_path / "runs" / "tiny_grpo_split-sync-naive"))
    assert _predicted(section) == ["sync-naive"]
    assert "<td>measured run</td><td>2.000</td><td>32.00</td><td>0.50</td>" in section  # torn last row skipped
    assert "<td>measured / predicted</td>" in section
    assert "schedule <b>sync-naive</b> (from its folder&#x27;s name tiny_grpo_split-sync-naive)" in section


def test_the_run_schedule_from_its_rows_or_the_option_or_every_one(aspc, tmp_path):
    rows_say = _metrics(tmp_path / "a" / "elsewhere", {"schedule": "sync"})
    assert _predicted(_run_section(aspc, tmp_path, rows_say)) == ["sync"]
    unknown = _metrics(tmp_path / "b" / "elsewhere")
    assert _predicted(_run_section(aspc, tmp_path, unknown, "--run-schedule", "asp")) == ["asp"]
    section = _run_section(aspc, tmp_path, unknown)
    assert _predicted(section) == ["sync-naive", "sync", "asp"] and "--run-schedule" in section
    assert "<td>measured / predicted</td>" not in section


def _charts(section: str) -> list[ET.Element]:
    return [ET.fromstring(svg) for svg in re.findall(r'<figure class="chart">.*?(<svg.*?</svg>)', section, re.S)]


def test_measured_charts_have_axes_a_person_can_read(aspc, tmp_path):
    section = _run_section(aspc, tmp_path, _metrics(tmp_path / "runs" / "tiny_grpo_split-asp"))
    charts = _charts(section)
    assert len(charts) == 4  # reward, staleness, tokens/s, bubble shares (no response_len in these rows)
    for svg in charts:
        assert float(svg.get("width")) >= 400 and float(svg.get("height")) >= 200
        texts = {t.get("class"): [] for t in svg.iter(f"{{{SVG_NAMESPACE}}}text")}
        for t in svg.iter(f"{{{SVG_NAMESPACE}}}text"):
            texts[t.get("class")].append(t.text)
        assert texts["axis-title x"] == ["step"] and texts["axis-title y"][0]
        assert texts["tick x"] == ["1", "2", "3"] and len(texts["tick y"]) >= 3
    assert '<span class="swatch" style="background:#2e7d32"></span>useful' in section  # the bubbles' key


def test_report_and_simulate_print_the_same_speed_ups(aspc, tmp_path):
    """Both simulate as many steps by default, and the report says how many."""
    from aspc.cli.main import main

    def default_steps(command):
        return next(p.default for p in main.commands[command].params if p.name == "steps")

    assert default_steps("report") == default_steps("simulate")
    report = aspc("report", PIPELINE, "-o", str(tmp_path / "r.html"), "--steps", "3")
    simulate = aspc("simulate", PIPELINE, "--compare", "--steps", "3")
    lines = simulate.output.splitlines()
    head = next(line for line in lines if line.startswith("| schedule |")).split(" | ")
    asp = dict(zip(head, next(line for line in lines if line.startswith("| asp |")).split(" | ")))
    assert (f"asp: {asp['vs sync-naive']} vs sync-naive, {asp['vs sync']} vs sync (e2e_tps over 3 simulated steps)"
            in report.output)
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Over 3 simulated steps per schedule: <code>aspc simulate FILE --compare --steps 3</code>" in page


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


def test_the_training_inference_mismatch_of_a_run_is_charted(aspc, tmp_path):
    """Rows with the engine's log-probs against the trainer's (aspc/rl/mismatch.py) get two charts."""
    rows = _metrics(tmp_path / "runs" / "tiny_grpo_split-asp", {"mismatch_abs": 2e-6, "mismatch_kl": 1e-11,
                                                                "mismatch_max": 3e-5, "mismatch_tokens": 96})
    section = _run_section(aspc, tmp_path, rows)
    assert len(_charts(section)) == 6
    assert "training-inference mismatch" in section and "KL(engine || trainer) per token" in section
