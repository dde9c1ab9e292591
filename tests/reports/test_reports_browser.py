"""report.html in a real browser: it opens offline without console errors, and a screenshot
shows the verdict banner at the top and the TTFT plot's points.

Needs Debian's chromium at /usr/bin/chromium (`apt-get install chromium`); skipped without it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from reports.render import RenderResult

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="headless check needs /usr/bin/chromium (apt-get install chromium)",
)
_CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\] (.*)")
# Colours from reports/templates/report.html.j2 and reports/plots.py.
_VERDICT_COLOURS = {"leak": (0xB0, 0x3A, 0x2E), "clean": (0x1E, 0x84, 0x49)}


def _open(page: Path, tmp_path: Path, height: int = 2400) -> tuple[np.ndarray, list[str]]:
    """Screenshot a page headless and offline; returns its pixels and console messages."""
    screenshot = tmp_path / f"{page.parent.name}-{page.stem}.png"
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        f"--window-size=1280,{height}",
        f"--screenshot={screenshot}",
        page.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert screenshot.exists(), result.stderr[-2000:]
    console = [m.group(1) for m in map(_CONSOLE.search, result.stderr.splitlines()) if m]
    return np.asarray(Image.open(screenshot).convert("RGB")).astype(int), console


def _matching(pixels: np.ndarray, colour: tuple[int, ...], tolerance: int = 6) -> np.ndarray:
    matching: np.ndarray = np.all(np.abs(pixels - np.array(colour)) <= tolerance, axis=-1)
    return matching


def _blue(pixels: np.ndarray) -> np.ndarray:
    """The TTFT plot's accepted-request points (#2e6da4, any alpha): the page's only blue."""
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    blues: np.ndarray = (blue - red > 60) & (blue - green > 20)
    return blues


def test_the_console_check_sees_errors(tmp_path: Path) -> None:
    page = tmp_path / "broken.html"
    page.write_text('<script>console.error("seen"); undefined_function()</script>')
    _, console = _open(page, tmp_path, height=200)
    assert any("seen" in message for message in console)
    assert any("undefined_function" in message for message in console)


@pytest.mark.parametrize("scenario", ["vulnerable", "clean"])
def test_report_opens_cleanly_with_verdict_and_ttft_plot(
    rendered: dict[str, RenderResult], tmp_path: Path, scenario: str
) -> None:
    result = rendered[scenario]
    pixels, console = _open(result.paths["html"], tmp_path)
    assert console == []
    banner = _matching(pixels[:90], _VERDICT_COLOURS[str(result.verdict)])
    assert banner.mean() > 0.8, "the verdict banner is not at the top of the page"
    assert _blue(pixels[90:]).sum() > 50, "no accepted-request points of the TTFT plot are visible"
