"""The report page as a person sees it: opened in headless Chromium (Debian's package, driven by
Playwright), with the network blocked. It renders without script errors, shows every section, draws
each schedule's timeline across the width (dapo_32b: a long-tail pipeline, its sync-naive ten times
longer than asp), zooms about the cursor, keeps the schedule graph inside the page, answers hover and
the schedule picker, and leaves a screenshot.

Needs `playwright` (pip) and a Chromium (`apt-get install chromium`; or ASPC_CHROMIUM=PATH). Without
them the test skips, saying which is missing, unless ASPC_REQUIRE_BROWSER=1 (set by .ci/run), where
it fails. ASPC_ARTIFACTS=DIR keeps the screenshot there (CI's artefact)."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import ROOT

PIPELINE = ROOT / "pipelines" / "dapo_32b.aspl"  # sync-naive's timeline is ~10x asp's
# as root, without a sandbox; no background connections (the machine's network is closed anyway)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
NARROW = 1000  # px: a window narrower than the schedule graph's natural width


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser's path, or skip (fail in CI) saying what is missing, before any page is made."""
    missing = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "playwright is not installed (pip install playwright)"
    path = os.environ.get("ASPC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if missing is None and not path:
        missing = "no Chromium found (apt-get install chromium, or set ASPC_CHROMIUM)"
    if missing and os.environ.get("ASPC_REQUIRE_BROWSER") == "1":
        pytest.fail(f"the browser test must run here (ASPC_REQUIRE_BROWSER=1): {missing}")
    if missing:
        pytest.skip(missing)
    return path


@pytest.fixture(scope="module")
def report_file(tmp_path_factory) -> Path:
    from click.testing import CliRunner

    from aspc.cli.main import main

    out = tmp_path_factory.mktemp("browser") / "report.html"
    result = CliRunner().invoke(main, ["report", str(PIPELINE), "-o", str(out), "--steps", "2"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_report_renders_in_a_browser_offline(chromium, report_file, tmp_path):
    from playwright.sync_api import sync_playwright

    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000}, offline=True)
            context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                          else route.abort())
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report_file.as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=15_000)
            _check_sections(page)
            _check_timeline(page)
            _check_each_timeline_fills_the_width(page)
            _check_wheel_keeps_the_point_under_the_cursor(page)
            _check_buttons_zoom_about_the_left_edge(page)
            _check_picker(page)
            page.screenshot(path=str(_artefacts(tmp_path) / "report.png"), full_page=True)
            _check_graph_fits_the_page(page)
        finally:
            browser.close()
    assert errors == []
    assert requests == [report_file.as_uri()]  # the page itself, nothing else


def _check_sections(page) -> None:
    for section in ("#timelines", "#bubbles", "#throughput", "#source", "#graph"):
        assert page.locator(section).is_visible()
    box = page.locator("#timeline").bounding_box()
    assert box["width"] > 600 and box["height"] > 3 * 2 * _layout(page)["row"]
    assert page.locator("table.throughput tbody tr").count() >= 3
    assert page.locator("svg.schedule-graph[data-schedule=asp] g.node").count() >= 6
    assert page.locator(".note.decision[data-schedule=asp]").first.is_visible()


def _layout(page) -> dict:
    """Where page.js draws: the plot's left and right margins, the row height, each schedule's rows."""
    return json.loads(page.locator("#timeline").get_attribute("data-layout"))


def _check_timeline(page) -> None:
    canvas, layout = page.locator("#timeline").bounding_box(), _layout(page)
    first = layout["panels"][0]
    page.mouse.move(canvas["x"] + layout["left"] + 20, canvas["y"] + first["rows_top"] + layout["row"] / 2)
    tip = page.locator("#timeline-tip")
    assert tip.is_visible() and tip.inner_text().startswith("sync-naive \u00b7 gen[0]")
    before = page.locator("#timeline").get_attribute("data-view")
    page.click("#zoom-in")
    assert page.locator("#timeline").get_attribute("data-view") != before
    page.dblclick("#timeline")
    assert page.locator("#timeline").get_attribute("data-view") == before


# The canvas's pixels in a schedule's rows: the share of the plot's width between its left-most and
# right-most painted pixel (a span's colour; not the clear background, the hatching or the grid lines).
PAINTED_SHARE = """(layout) => {
  const canvas = document.getElementById("timeline"), ctx = canvas.getContext("2d");
  const scale = canvas.width / canvas.clientWidth, right = canvas.clientWidth - layout.right;
  return layout.panels.map((p) => {
    let lo = Infinity, hi = -Infinity;
    for (let r = 0; r < p.rows; r++) {
      const y = Math.round((p.rows_top + r * layout.row + layout.row / 2) * scale);
      const px = ctx.getImageData(0, y, canvas.width, 1).data;
      for (let x = Math.ceil(layout.left * scale); x < right * scale; x++) {
        const [red, green, blue, alpha] = px.slice(4 * x, 4 * x + 4);
        const colour = Math.max(red, green, blue) - Math.min(red, green, blue) > 24 || Math.max(red, green, blue) < 210;
        if (alpha > 200 && colour) {
          lo = Math.min(lo, x); hi = Math.max(hi, x);
        }
      }
    }
    return [p.name, (hi - lo) / scale / (right - layout.left)];
  });
}"""


def _painted(page) -> dict[str, float]:
    return dict(page.evaluate(PAINTED_SHARE, _layout(page)))


def _check_each_timeline_fills_the_width(page) -> None:
    """On load every schedule is fitted to the width; on one time axis asp is a tenth of it."""
    fitted = _painted(page)
    assert set(fitted) == {"sync-naive", "sync", "asp"}
    assert all(share > 0.95 for share in fitted.values()), fitted
    page.check("#shared-axis")
    shared = _painted(page)
    assert shared["sync-naive"] > 0.95 and shared["asp"] < 0.3, shared  # lengths compared
    page.uncheck("#shared-axis")
    assert _painted(page) == fitted


def _view(page) -> tuple[float, float]:
    start, end = page.locator("#timeline").get_attribute("data-view").split("-")
    return float(start), float(end)


def _fraction_under(page, x: float) -> float:
    """The fraction of each schedule's scale at x px from the canvas's left edge."""
    layout, (start, end) = _layout(page), _view(page)
    plot = page.locator("#timeline").bounding_box()["width"] - layout["left"] - layout["right"]
    return start + (x - layout["left"]) / plot * (end - start)


def _time_in_tip(page) -> float:
    return float(re.search(r"\nat ([\d.]+) s$", page.locator("#timeline-tip").inner_text()).group(1))


def _check_wheel_keeps_the_point_under_the_cursor(page) -> None:
    canvas, layout = page.locator("#timeline").bounding_box(), _layout(page)
    asp = next(p for p in layout["panels"] if p["name"] == "asp")
    x = layout["left"] + 0.7 * (canvas["width"] - layout["left"] - layout["right"])
    page.mouse.move(canvas["x"] + x, canvas["y"] + asp["rows_top"] + layout["row"] / 2)
    before, seconds = _fraction_under(page, x), _time_in_tip(page)
    for _ in range(3):
        page.mouse.wheel(0, -100)  # zoom in
    start, end = _view(page)
    assert end - start < 0.6
    assert _fraction_under(page, x) == pytest.approx(before, abs=1e-9)
    assert _time_in_tip(page) == pytest.approx(seconds, abs=2.0)  # asp's 2229 s: about 1 s a pixel
    page.dblclick("#timeline")
    assert _view(page) == (0, 1)


def _check_buttons_zoom_about_the_left_edge(page) -> None:
    page.click("#zoom-in")
    assert _view(page) == (0, 0.5)  # the data starts at the left edge: it stays in view
    page.click("#zoom-reset")


def _check_graph_fits_the_page(page) -> None:
    """In a narrow window the graph shrinks: every stage, its text included, stays in the page."""
    page.set_viewport_size({"width": NARROW, "height": 1000})
    box = page.locator(".graph-box").bounding_box()
    svg = page.locator("svg.schedule-graph[data-schedule=sync]")
    picture = svg.bounding_box()
    assert picture["x"] + picture["width"] <= box["x"] + box["width"] + 0.5
    for node in svg.locator("g.node").all():
        stage = node.bounding_box()
        assert stage["x"] + stage["width"] <= picture["x"] + picture["width"] + 0.5, node.get_attribute("data-stage")


def _check_picker(page) -> None:
    assert page.locator("svg.schedule-graph[data-schedule=asp]").is_visible()
    page.check(".picker input[value=sync]")
    assert page.locator("svg.schedule-graph[data-schedule=sync]").is_visible()
    assert not page.locator("svg.schedule-graph[data-schedule=asp]").is_visible()


def _artefacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ASPC_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
