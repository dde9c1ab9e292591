"""report.html in a real browser, as a person first sees it.

Playwright drives Debian's Chromium (`/usr/bin/chromium`, installed by `scripts/system-deps`)
headless, offline and with an empty profile. Every request the page makes is routed through
a guard that fails the test on anything but `file:` and `data:` URLs (the report must be
self-contained), console errors are collected, and the checks are on what is visible: the
verdict sentence and the leak matrix at the top, every plot image loaded and on screen. A
screenshot of the top of the page is saved as an artefact (its path is printed).

Skipped, with the reason, only where Playwright or Chromium is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from kvcanary.reports.render import RenderResult

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
