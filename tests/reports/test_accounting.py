"""The journal invariant (`reports.accounting`): every plan observed exactly once, but for
the requests a crash lost; violations named; `kvcanary report` checks it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from run_journals import TENANTS, RunRecorder

from kvcanary.harness.cli import main
from kvcanary.harness.record.events import ObservationRecorded, PlanRecorded
from kvcanary.reports.accounting import Accounting, account_lines, account_requests


def request(recorder: RunRecorder, tenant: str = "alice", *, answered: bool = True) -> str:
    made = recorder.victim(tenant, "small", 512, prompt_tokens=512, answered=answered)
    return made.plan.request_id


def session(
    run_dir: Path, num_answered: int, num_in_flight: int = 0, *, first: int = 0
) -> list[str]:
    """One session of a run: `num_answered` requests, then `num_in_flight` planned ones,
    numbered on from `first` (as a resumed soak numbers them)."""
    recorder = RunRecorder(run_dir, "run")
    recorder.num_requests = first
    recorder.start(TENANTS)
    recorder.phase("fill")
    for _ in range(num_answered):
        request(recorder)
    return [request(recorder, answered=False) for _ in range(num_in_flight)]


def test_a_finished_run_accounts_for_every_plan(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run")
    recorder.start(TENANTS)
    for tenant in ("alice", "bob", "alice"):
        request(recorder, tenant)
    recorder.finish("completed")
    accounting = account_requests(tmp_path)
    assert accounting == Accounting(1, 3, 3, (), (), (), (), (), 0, 0)
    assert accounting.consistent
    assert accounting.problems() == []
    assert accounting.describe() == "journal: 3 planned, 3 observed in 1 session(s)"


def test_plans_in_flight_at_a_kill_are_lost_not_a_defect(tmp_path: Path) -> None:
    lost = session(tmp_path, 4, num_in_flight=2)  # killed: no run_finished
    with (tmp_path / "journal.jsonl").open("ab") as journal:  # ... in the middle of a line
        journal.write(b'{"type":"observation","request_id":"ru')
    lost += session(tmp_path, 3, num_in_flight=1, first=6)  # resumed, killed again
    accounting = account_requests(tmp_path)
    assert accounting.consistent, accounting.problems()
    assert accounting.lost_to_crash == tuple(lost)
    assert accounting.num_torn_lines == 1
    assert accounting.num_sessions == accounting.num_unended_sessions == 2
    assert accounting.describe() == (
        "journal: 10 planned, 7 observed in 2 session(s); 3 in flight when 2 session(s) were "
        "killed (no observation); 1 torn line(s) skipped"
    )


def test_every_violation_is_named(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run")
    recorder.start(TENANTS)
    answered = recorder.victim("alice", "small", 5)
    assert answered.observation is not None
    unobserved = request(recorder, "bob", answered=False)
    # a retry journaled as a second observation, and an observation without its plan
    recorder.writer.write(ObservationRecorded(answered.observation))
    stray = dataclasses.replace(answered.observation, request_id="nobody-r1")
    recorder.writer.write(ObservationRecorded(stray))
    recorder.finish("completed")
    recorder = RunRecorder(tmp_path, "run")  # a resumed session that reuses a number
    recorder.start(TENANTS)
    recorder.writer.write(PlanRecorded(answered.plan))
    recorder.writer.write(ObservationRecorded(answered.observation))
    recorder.finish("completed")
    accounting = account_requests(tmp_path)
    assert not accounting.consistent
    first = answered.plan.request_id
    assert accounting.problems() == [
        f"1 request(s) planned in a session that ended but never observed: {unobserved}",
        f"2 request(s) observed more than once: {first}, {first}",
        f"1 request(s) planned more than once: {first}",
        "1 request(s) observed without a plan: nobody-r1",
    ]


def test_a_retry_field_is_not_a_second_observation(tmp_path: Path) -> None:
    lines = [
        b'{"type":"run_started","run_id":"r"}',
        b'{"type":"plan","request_id":"t0-r000001","tenant":"t"}',
        b'{"type":"observation","request_id":"t0-r000001","retry":"RemoteProtocolError: x"}',
        b'{"type":"run_finished","reason":"completed"}',
    ]
    assert account_lines(lines).consistent


def test_records_in_another_field_order_are_read_whole() -> None:
    lines = [
        b'{"type":"run_started"}\n',
        b'{"type":"plan","tenant":"t","request_id":"a\\"b"}\n',
        b'{"request_id":"a\\"b","type":"observation"}\n',
        b'{"type":"run_finished"}\n',
    ]
    accounting = account_lines(lines)
    assert (accounting.num_plans, accounting.num_observations) == (1, 1)
    assert accounting.consistent


def test_kvcanary_report_says_what_a_crash_lost_and_names_defects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = tmp_path / "killed"
    session(killed, 2, num_in_flight=1)
    main(["report", str(killed), "--format", "json"])
    printed = capsys.readouterr()
    assert "1 in flight when 1 session(s) were killed" in printed.out
    assert "journal check" not in printed.err

    broken = tmp_path / "broken"
    recorder = RunRecorder(broken, "run")
    recorder.start(TENANTS)
    request(recorder, answered=False)
    recorder.finish("completed")
    status = main(["report", str(broken), "--format", "json"])
    err = capsys.readouterr().err
    assert "kvcanary: report: journal check: 1 request(s) planned in a session that ended" in err
    assert status != 0
