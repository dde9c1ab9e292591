"""Repository-root pytest configuration.

A run that collects no test is a broken run (a wrong path, a renamed folder, an import
error swallowed by a filter), never a pass: pytest's exit status 5 is turned into a failure
with a message that says so.
"""

from __future__ import annotations

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "kvcanary: no tests ran; that is a failure here (check the test paths / -k).",
                red=True,
            )
