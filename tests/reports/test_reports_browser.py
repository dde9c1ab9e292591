"""report.html in a real browser, as a person first sees it.

Playwright drives Debian's Chromium (`/usr/bin/chromium`, installed by `scripts/system-deps`)
headless, offline and with an empty profile. Every request the page makes is routed through
a guard that fails the test on anything but `file:` and `data:` URLs (the report must be
self-contained), console errors are collected, and the checks are on what is visible: the
verdict sentence and the leak matrix at the top, every plot image loaded and on screen. A
screenshot of the top of the page is saved as an artefact (its path is printed). The layout
is measured at 800, 1280 and 1920 px for a leak, a clean and a soak report: the header, the
leak matrix and every check card each keep their own pixels, no card's text is cut, and the
page never scrolls sideways.

Skipped, with the reason, only where Playwright or Chromium is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import run_journals
from PIL import Image

from kvcanary.canaries.shape import WORDS
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.reports.render import RenderResult, render_run

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="the browser test needs Playwright (pip install playwright; in the dev extra)",
    ),
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="the browser test needs /usr/bin/chromium (apt-get install chromium; "
        "scripts/system-deps does it where it can)",
    ),
]
_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Colours from reports/templates/report.html.j2.
_VERDICT_COLOURS = {"leak": (0xB0, 0x3A, 0x2E), "clean": (0x1E, 0x84, 0x49)}


class Visit:
    """One page load: what it requested off the machine, and what its console said."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.outside: list[str] = []
        self.console_errors: list[str] = []
        page.route("**/*", self._guard)
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.console_errors.append(str(error)))

    def _guard(self, route: Any) -> None:
        url = route.request.url
        if url.startswith(("file:", "data:")):
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium with an empty profile of its own."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            headless=True,
            args=_ARGS,
            viewport={"width": 1280, "height": 900},
            offline=True,
        )
        yield context
        context.close()


def _visit(browser: Any, path: Path) -> Visit:
    visit = Visit(browser.new_page())
    visit.page.goto(path.as_uri(), wait_until="load")
    return visit


def test_the_guards_see_network_requests_and_console_errors(browser: Any, tmp_path: Path) -> None:
    page = tmp_path / "broken.html"
    page.write_text(
        '<img src="http://example.invalid/tracker.png">'
        '<script>console.error("seen"); undefined_function()</script>'
    )
    visit = _visit(browser, page)
    visit.page.close()
    assert visit.outside == ["http://example.invalid/tracker.png"]
    assert any("seen" in message for message in visit.console_errors)
    assert any("undefined_function" in message for message in visit.console_errors)


@pytest.mark.parametrize("scenario", ["vulnerable", "clean"])
def test_report_shows_verdict_matrix_and_plots_offline(
    rendered: dict[str, RenderResult], browser: Any, tmp_path: Path, scenario: str
) -> None:
    result = rendered[scenario]
    visit = _visit(browser, result.paths["html"])
    page = visit.page
    screenshot = tmp_path / f"report-{scenario}-top.png"
    page.screenshot(path=str(screenshot))  # the viewport: the top of the page
    print(f"screenshot of the top of the {scenario} report: {screenshot}")

    sentence = page.locator("#verdict-sentence")
    assert sentence.is_visible()
    assert sentence.inner_text().startswith(f"{str(result.verdict).upper()}: ")
    matrix = page.locator("#leak-matrix table")
    assert matrix.is_visible()
    box = matrix.bounding_box()
    assert box is not None
    assert box["y"] + box["height"] <= 900, "the matrix is below the fold"
    cells = matrix.locator("td").all_inner_texts()
    assert len(cells) == 9  # alice, bob, mallory as readers and as owners
    expected_leaks = 1 if scenario == "vulnerable" else 0
    assert sum(int(text) for text in cells if text.strip().isdigit()) == expected_leaks

    images = page.locator("img")
    assert images.count() == (3 if scenario == "vulnerable" else 2)  # no findings plot if clean
    for index in range(images.count()):
        image = images.nth(index)
        image.scroll_into_view_if_needed()
        assert image.is_visible()
        assert image.evaluate("img => img.complete && img.naturalWidth > 0"), "image not loaded"
    assert page.locator("img[src^='data:image/png;base64,']").count() == images.count()
    assert visit.outside == [], "the report reached off the machine"
    assert visit.console_errors == []
    page.close()

    pixels = np.asarray(Image.open(screenshot).convert("RGB")).astype(int)
    banner = np.all(
        np.abs(pixels[:90] - np.array(_VERDICT_COLOURS[str(result.verdict)])) <= 6, axis=-1
    )
    assert banner.mean() > 0.8, "the verdict banner is not at the top of the page"


def test_checks_that_did_not_run_say_so_on_the_page(
    rendered: dict[str, RenderResult], browser: Any
) -> None:
    visit = _visit(browser, rendered["clean"].paths["html"])
    checks = visit.page.locator("#checks")
    assert checks.is_visible()
    text = checks.inner_text()
    visit.page.close()
    assert "not run: pool sizes are audited by `kvcanary audit`" in text
    assert "not run: the cache probe did not run" in text


# -- layout: the top of the page at every width ------------------------------------------

WIDTHS = (800, 1280, 1920)
SOAK_TENANTS = [
    {"name": f"tenant-{i}", "api_key_env": None, "header_names": [], "weight": 1.0}
    for i in range(4)
]


def soak_run(run_dir: Path) -> Path:
    """A soak's periodic report: four tenants, a cross-tenant leak and an `unknown_canary`
    that is the reader's own canary with three words spliced in (the matrix grows an
    "unknown origin" column)."""
    recorder = run_journals.RunRecorder(run_dir, "run-soak")
    recorder.start(SOAK_TENANTS)
    recorder.phase("soak")
    requests = [
        recorder.victim(f"tenant-{i % 4}", "medium", 1024, phase="soak", prompt_tokens=1024)
        for i in range(12)
    ]
    recorder.timing()
    reader, victim = requests[-1], requests[-2]
    own = reader.plan.canaries[0].text
    spliced = " ".join([*own.split()[:4], *WORDS[:3]])  # tag + 3 own words + 3 others
    recorder.finding(
        Finding(
            kind=FindingKind.UNKNOWN_CANARY,
            severity=Severity.MEDIUM,
            detector="content",
            request_id=reader.plan.request_id,
            tenant=reader.plan.tenant,
            summary="tenant-3's response contained a canary-shaped marker this run never minted",
            marker=spliced,
            offsets=(10, 10 + len(spliced)),
            excerpt=f"[… 10 chars redacted …] {own} [… 4 chars redacted …] {spliced} [… 9 …]",
        )
    )
    marker = victim.plan.canaries[0].text
    recorder.finding(
        Finding(
            kind=FindingKind.CROSS_TENANT_CANARY,
            severity=Severity.CRITICAL,
            detector="content",
            request_id=reader.plan.request_id,
            tenant=reader.plan.tenant,
            summary=f"tenant-3's response held tenant-2's canary from {victim.plan.request_id}",
            victim_tenant=victim.plan.tenant,
            victim_request_id=victim.plan.request_id,
            marker=marker,
            offsets=(0, len(marker)),
            excerpt=f"{marker} [… 30 chars redacted …]",
        )
    )
    recorder.finish("duration")
    return run_dir


@pytest.fixture(scope="module")
def layouts(
    rendered: dict[str, RenderResult], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """A leak, a clean and a soak report."""
    soak = render_run(soak_run(tmp_path_factory.mktemp("soak") / "soak"))
    return {
        "leak": rendered["vulnerable"].paths["html"],
        "clean": rendered["clean"].paths["html"],
        "soak": soak.paths["html"],
    }


_MEASURE = """() => {
  const box = element => {
    const r = element.getBoundingClientRect();
    return {left: r.left, top: r.top, right: r.right, bottom: r.bottom};
  };
  const blocks = [["header", document.querySelector("#verdict")],
                  ["matrix", document.querySelector("#leak-matrix")],
                  ["matrix table", document.querySelector("#leak-matrix table")],
                  ...[...document.querySelectorAll("#checks .check")].map(
                    (card, i) => ["card " + i + " " + card.querySelector(".k").innerText, card])];
  const clipped = [...document.querySelectorAll("#checks .check, .matrix-scroll")]
    .filter(e => e.scrollWidth > e.clientWidth || e.scrollHeight > e.clientHeight)
    .map(e => e.innerText.split("\\n").join(" "));
  return {blocks: blocks.map(([name, e]) => [name, box(e)]), clipped,
          pageWidth: document.documentElement.scrollWidth, viewport: window.innerWidth,
          columns: [...document.querySelectorAll("#leak-matrix tr:first-child th")]
            .map(th => th.innerText)};
}"""


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether two boxes share pixels (touching edges do not count)."""
    width = min(a["right"], b["right"]) - max(a["left"], b["left"])
    height = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
    return width > 0.5 and height > 0.5


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("report", ["leak", "clean", "soak"])
def test_header_matrix_and_cards_never_overlap_clip_or_scroll_sideways(
    layouts: dict[str, Path], browser: Any, report: str, width: int
) -> None:
    page = browser.new_page()
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(layouts[report].as_uri(), wait_until="load")
    seen = page.evaluate(_MEASURE)
    page.close()
    assert seen["viewport"] == width
    assert seen["pageWidth"] <= width, "the page scrolls sideways"
    assert seen["clipped"] == [], "text cut off or scrolled inside a card or the matrix"
    blocks = seen["blocks"]
    assert len(blocks) == 3 + len(FindingKind)
    overlapping = [
        (first, second)
        for i, (first, a) in enumerate(blocks)
        for second, b in blocks[i + 1 :]
        if _overlap(a, b) and {first, second} != {"matrix", "matrix table"}  # one holds the other
    ]
    assert overlapping == []
    for name, box in blocks:
        assert box["left"] >= 0, f"{name} is off the page"
        assert box["right"] <= width, f"{name} is off the page"
    if report == "soak":  # every owner's column is there, "unknown origin" last
        assert seen["columns"][1:] == [*(t["name"] for t in SOAK_TENANTS), "unknown origin"]


def test_what_to_do_opens_the_leak_report_and_explains_the_spliced_canary(
    layouts: dict[str, Path], browser: Any
) -> None:
    page = browser.new_page()
    page.goto(layouts["soak"].as_uri(), wait_until="load")
    section = page.locator("#what-to-do")
    assert section.is_visible()
    text = section.inner_text()
    plots = page.locator("#plots").bounding_box()
    top = section.bounding_box()
    page.close()
    assert plots is not None
    assert top is not None
    assert top["y"] < plots["y"]  # what to do comes before the plots
    assert "cross_tenant_canary (1): One tenant's response quoted another tenant's prompt" in text
    assert "--disaggregation-enable-kv-checksum" in text
    assert "SGLang #38935 (merged)" in text
    assert (
        "1 of 1 unknown marker finding(s) share half or more of their words with the canaries "
        "next to them (this run's own canaries, spliced)" in text
    )
