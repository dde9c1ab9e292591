"""Fixtures for report tests: recorded journals (see run_journals.py) and their renders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import run_journals

from kvcanary.reports.render import RenderResult, render_run

SCENARIOS: dict[str, Callable[[Path], Path]] = {
    "vulnerable": run_journals.vulnerable_run,
    "clean": run_journals.clean_run,
    "interrupted": run_journals.interrupted_run,
    "unreachable": run_journals.unreachable_run,
}


@pytest.fixture
def record(tmp_path: Path) -> Callable[[str], Path]:
    """Record a fresh journal of the named scenario; returns its run directory."""

    def make(name: str) -> Path:
        return SCENARIOS[name](tmp_path / name)

    return make


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RenderResult]:
    """Every scenario recorded and rendered once, in all formats (read-only for tests)."""
    results = {}
    for name, scenario in SCENARIOS.items():
        run_dir = scenario(tmp_path_factory.mktemp("rendered") / name)
        results[name] = render_run(run_dir)
    return results
