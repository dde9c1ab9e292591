"""The accounting found in the report's first pass: the same as reading the lines again, or
left to that exact pass when ids must be named."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_journals import TENANTS, RunRecorder
from test_accounting import request, session

from kvcanary.harness.record.events import PlanRecorded
from kvcanary.reports import journal_lines
from kvcanary.reports.accounting import account_requests
from kvcanary.reports.journal_scan import rare_events


def finished_sessions(run_dir: Path, sizes: list[int]) -> None:
    first = 0
    for size in sizes:
        recorder = RunRecorder(run_dir, "run")
        recorder.num_requests = first
        recorder.start(TENANTS)
        for tenant in ("alice", "bob", "mallory") * size:
            request(recorder, tenant)
        recorder.finish("completed")
        first += 3 * size


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 700])  # sessions cut across chunks too
def test_finished_sessions_are_accounted_in_the_first_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    monkeypatch.setattr(journal_lines, "CHUNK_BYTES", chunk_bytes)
    finished_sessions(tmp_path, [5, 0, 7])
    found = rare_events(tmp_path).accounting
    assert found is not None
    assert found == account_requests(tmp_path)
    assert (found.num_sessions, found.num_plans, found.consistent) == (3, 36, True)


def test_a_session_left_unended_is_counted(tmp_path: Path) -> None:
    finished_sessions(tmp_path, [2])
    session(tmp_path, 3, first=6)  # all answered, but no run_finished: killed at the end
    found = rare_events(tmp_path).accounting
    assert found == account_requests(tmp_path)
    assert found is not None
    assert found.num_unended_sessions == 1


def test_what_needs_ids_named_is_left_to_the_exact_pass(tmp_path: Path) -> None:
    lost = session(tmp_path / "crash", 4, num_in_flight=2)
    assert rare_events(tmp_path / "crash").accounting is None
    assert len(account_requests(tmp_path / "crash").lost_to_crash) == len(lost)
    recorder = RunRecorder(tmp_path / "twice", "run")
    recorder.start(TENANTS)
    made = recorder.victim("alice", "small", 5)
    recorder.writer.write(PlanRecorded(made.plan))  # planned again
    recorder.finish("completed")
    assert rare_events(tmp_path / "twice").accounting is None
    assert not account_requests(tmp_path / "twice").consistent
