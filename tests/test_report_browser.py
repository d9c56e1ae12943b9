"""The report page as a person sees it: opened in headless Chromium (Debian's package, driven by
Playwright), with the network blocked. It renders without script errors, shows every section,
answers hover, zoom and the schedule picker, and leaves a screenshot.

Needs `playwright` (pip) and a Chromium (`apt-get install chromium`; or ASPC_CHROMIUM=PATH). Without
them the test skips, saying which is missing, unless ASPC_REQUIRE_BROWSER=1 (set by .ci/run), where
it fails. ASPC_ARTIFACTS=DIR keeps the screenshot there (CI's artefact)."""
import os
import shutil
from pathlib import Path

import pytest

from conftest import ROOT

PIPELINE = ROOT / "pipelines" / "tiny_grpo_split.aspl"
# as root, without a sandbox; no background connections (the machine's network is closed anyway)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
AXIS, HEAD, ROW, LEFT = 26, 22, 16, 120  # the canvas layout of page.js


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
            _check_picker(page)
            page.screenshot(path=str(_artefacts(tmp_path) / "report.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert requests == [report_file.as_uri()]  # the page itself, nothing else


def _check_sections(page) -> None:
    for section in ("#timelines", "#bubbles", "#throughput", "#source", "#graph"):
        assert page.locator(section).is_visible()
    box = page.locator("#timeline").bounding_box()
    assert box["width"] > 600 and box["height"] > 3 * (HEAD + 2 * ROW)
    assert page.locator("table.throughput tbody tr").count() >= 3
    assert page.locator("svg.schedule-graph[data-schedule=asp] g.node").count() >= 6
    assert page.locator(".note.decision[data-schedule=asp]").first.is_visible()


def _check_timeline(page) -> None:
    canvas = page.locator("#timeline").bounding_box()
    page.mouse.move(canvas["x"] + LEFT + 20, canvas["y"] + AXIS + HEAD + ROW / 2)  # sync-naive, first row
    tip = page.locator("#timeline-tip")
    assert tip.is_visible() and tip.inner_text().startswith("sync-naive \u00b7 gen[0]")
    before = page.locator("#timeline").get_attribute("data-view")
    page.click("#zoom-in")
    assert page.locator("#timeline").get_attribute("data-view") != before
    page.dblclick("#timeline")
    assert page.locator("#timeline").get_attribute("data-view") == before


def _check_picker(page) -> None:
    assert page.locator("svg.schedule-graph[data-schedule=asp]").is_visible()
    page.check(".picker input[value=sync]")
    assert page.locator("svg.schedule-graph[data-schedule=sync]").is_visible()
    assert not page.locator("svg.schedule-graph[data-schedule=asp]").is_visible()


def _artefacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ASPC_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
