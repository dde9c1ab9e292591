"""Repository-root pytest configuration.

A run that collects no test is a broken run (a wrong path, a renamed folder, an import
error swallowed by a filter), never a pass: pytest's exit status 5 is turned into a failure
with a message that says so.

Tests marked `soak` (the 20-minute soak) are deselected unless the `-m` expression names
`soak` (`pytest -m soak`): not by `addopts`, since a `-m "not slow"` on the command line
would replace that and run them.

Tests marked `timing` need the real wall clock and race against a loaded machine (a
prefill's duration, a KV write in flight, a cache hit's saving). Where no deterministic
clock can stand in, a failure is rerun up to `TIMING_RERUNS` times (pytest-rerunfailures);
every rerun is reported in the progress line (`R`) and named in the summary (`-raR`),
never hidden, and a test that fails every attempt fails the run.
"""

from __future__ import annotations

import pytest

TIMING_RERUNS = 2


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "kvcanary: no tests ran; that is a failure here (check the test paths / -k).",
                red=True,
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timing") is not None:
            item.add_marker(pytest.mark.flaky(reruns=TIMING_RERUNS, reruns_delay=1))
    if "soak" in (config.getoption("markexpr", "") or ""):
        return
    soaks = [item for item in items if item.get_closest_marker("soak") is not None]
    if soaks:
        config.hook.pytest_deselected(items=soaks)
        items[:] = [item for item in items if item.get_closest_marker("soak") is None]
