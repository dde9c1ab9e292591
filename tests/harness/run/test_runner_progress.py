"""The progress display: plain lines off a terminal, findings capped per kind."""

from __future__ import annotations

import dataclasses
import io

from kvcanary.harness.record.events import (
    FindingRecorded,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    RunFinished,
)
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run.progress import OUTSIDE_BUDGET_PHASES, ProgressDisplay
from kvcanary.tenants.plan import RequestPlan


def _plan(i: int) -> RequestPlan:
    return RequestPlan(f"r{i}", "tenant-0", "fill", "victim", "x", 10, "accept", "chat", "p")


def _obs(i: int, status: int | None, error_kind: str | None = None) -> Observation:
    return Observation(
        f"r{i}",
        "tenant-0",
        status,
        0.0,
        0,
        0,
        error_kind=error_kind,  # type: ignore[arg-type]
    )


def _finding(i: int) -> FindingRecorded:
    finding = Finding(
        FindingKind.CROSS_TENANT_CANARY,
        Severity.CRITICAL,
        "content",
        f"r{i}",
        "tenant-0",
        f"tenant-0's response to r{i} contained tenant-1's canary",
    )
    return FindingRecorded(finding, t_wall=0.0)


def test_plain_lines_show_phases_findings_and_counts() -> None:
    out = io.StringIO()
    display = ProgressDisplay(
        num_requests=10, file=out, live=False, interval_s=0, max_findings_shown=2
    )
    with display:
        display.handle(PhaseStarted("fill", 0.0))
        for i in range(4):
            display.handle(PlanRecorded(_plan(i)))
        display.handle(ObservationRecorded(_obs(0, 200)))
        display.handle(ObservationRecorded(_obs(1, 400, "http_status")))
        display.handle(ObservationRecorded(_obs(2, None, "connect")))
        display.handle(PlanRecorded(_plan(4)))
        display.handle(ObservationRecorded(_obs(4, 200, "disconnected")))
        for i in range(4):
            display.handle(_finding(i))
        display.handle(RunFinished("completed", 0.0, 4))
    text = out.getvalue()
    assert "phase fill" in text
    assert text.count("FINDING cross_tenant_canary") == 2  # capped
    assert "further cross_tenant_canary findings are counted" in text
    assert "response to r2" not in text  # the third finding is counted, not printed
    line = display.status_line()
    assert "4/10 requests" in line
    assert "1 aborted" in line
    assert "1 in flight" in line
    assert "1 rejected" in line
    assert "1 errors (connect 1)" in line
    assert "4 findings (cross_tenant_canary 4)" in line


def test_status_lines_are_rate_limited_off_a_terminal() -> None:
    out = io.StringIO()
    with ProgressDisplay(duration_s=60, file=out, live=False, interval_s=3600) as display:
        for i in range(50):
            display.handle(PlanRecorded(_plan(i)))
            display.handle(ObservationRecorded(_obs(i, 200)))
        assert "requests" not in out.getvalue()  # no status line within the interval
    assert out.getvalue().count("50 requests") == 1  # the closing status line
    assert "of 1m" in display.status_line()
    assert "no findings" in display.status_line()


def test_live_display_starts_and_stops_cleanly() -> None:
    out = io.StringIO()
    with ProgressDisplay(num_requests=2, file=out, live=True) as display:
        display.handle(PhaseStarted("probe", 0.0))
        display.handle(_finding(1))
    assert "FINDING cross_tenant_canary" in out.getvalue()
    assert "phase probe" in out.getvalue()


def test_cache_probe_requests_are_counted_apart_from_the_workload_budget() -> None:
    from kvcanary.harness.cache_probe.design import PHASE

    out = io.StringIO()
    with ProgressDisplay(num_requests=4, file=out, live=False, interval_s=3600) as display:
        for i in range(4):
            display.handle(PlanRecorded(_plan(i)))
            display.handle(ObservationRecorded(_obs(i, 200)))
        display.handle(PhaseStarted(PHASE, 0.0))
        for i in range(4, 99):
            display.handle(PlanRecorded(dataclasses.replace(_plan(i), phase=PHASE)))
            if i < 98:
                display.handle(ObservationRecorded(_obs(i, 200)))
    line = display.status_line()
    assert "4/4 requests" in line  # not 98/4: the probe is not the workload
    assert "94 cache-probe requests" in line
    assert "1 in flight" in line
    assert PHASE in OUTSIDE_BUDGET_PHASES
