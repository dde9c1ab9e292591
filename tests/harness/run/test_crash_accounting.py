"""Every planned request is journaled exactly once, however a run ends: Ctrl-C twice, SIGTERM,
and a soak SIGKILLed three times at random moments and resumed each time.

Checked with the journal invariant `kvcanary report` verifies (`reports.accounting`): every
plan has one observation, but for the requests in flight at a kill, which are counted as lost
to the crash. Separate processes against the fake target of `test_cli_run`.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from misbehaving_server import serve
from test_cli_run import (
    EXIT_WAIT_S,
    LIMIT_FLAGS,
    _running,
    _wait_for_lines,
    fake_target,
    of_type,
    records,
)

from kvcanary.harness.cli import main
from kvcanary.reports.accounting import account_requests

CONCURRENCY = 4


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c-twice"])
def test_an_interrupted_run_observes_every_plan_once(tmp_path: Path, how: str) -> None:
    argv = ["run", *LIMIT_FLAGS, "--requests", "5000", "--concurrency", str(CONCURRENCY)]
    with (
        serve(fake_target(delay_s=0.5)) as url,  # slow answers: requests are in flight
        _running([*argv, "--target", url, "--out", str(tmp_path)]) as proc,
    ):
        _wait_for_lines(tmp_path, "observation", 6, proc)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)  # the second cancels the requests in flight
        _, stderr = proc.communicate(timeout=EXIT_WAIT_S)
    assert proc.returncode == 3, stderr
    assert "Traceback" not in stderr
    accounting = account_requests(tmp_path)
    assert accounting.consistent, accounting.problems()
    assert accounting.lost_to_crash == ()
    assert accounting.num_plans == accounting.num_observations >= 6
    assert records(tmp_path)[-1]["reason"] == "interrupted"


def _wait_for_text(out: Path, text: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while text not in (out / "journal.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the soak never wrote {text}"
        time.sleep(0.05)


def test_a_soak_killed_three_times_and_resumed_loses_only_what_was_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "soak"
    argv = ["soak", *LIMIT_FLAGS, "--duration", "8s", "--concurrency", str(CONCURRENCY)]
    argv += ["--seed", "3", "--out", str(out)]
    pick = random.Random(16)
    with serve(fake_target(delay_s=0.02)) as url:
        num_seen = 0
        for kill in range(3):
            with _running([*argv, "--target", url]) as proc:
                num_seen += pick.randint(5, 40)  # a random moment of this session
                _wait_for_lines(out, "observation", num_seen, proc)
                if kill == 2:  # past fill (its 15 % of 8 s) however fast the machine is
                    _wait_for_text(out, '"phase":"probe"', proc)
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=30)
            assert records_until_torn(out)[-1]["type"] != "run_finished"
            if kill == 1:  # as if the kill had landed in the middle of a write
                with (out / "journal.jsonl").open("ab") as journal:
                    journal.write(b'{"type":"observation","request_id":"t0-r0')
            num_seen = (out / "journal.jsonl").read_text().count('"type":"observation"')
        assert main([*argv, "--target", url]) in (0, 3)  # the last session runs to the end
    capsys.readouterr()

    accounting = account_requests(out)
    assert accounting.consistent, accounting.problems()
    assert accounting.num_sessions == 4
    assert accounting.num_unended_sessions == 3
    assert len(accounting.lost_to_crash) <= 3 * CONCURRENCY
    assert accounting.num_torn_lines == 1
    assert accounting.num_observations == accounting.num_plans - len(accounting.lost_to_crash)

    rows = records_until_torn(out)
    started = [i for i, r in enumerate(rows) if r["type"] == "run_started"]
    elapsed = [rows[i]["settings"]["elapsed_before_s"] for i in started]
    assert elapsed[0] == 0
    assert elapsed == sorted(elapsed)
    assert elapsed[-1] > elapsed[1]
    assert len({rows[i]["run_id"] for i in started}) == 1  # one run, four sessions
    ids = [r["request_id"] for r in of_type(rows, "plan")]
    assert len(set(ids)) == len(ids)  # numbering continued past every kill
    # the phase schedule continued: the last session did not start over at fill
    last_phases = [r["phase"] for r in rows[started[-1] :] if r["type"] == "phase"]
    assert last_phases, rows
    assert last_phases[0] != "fill", last_phases
    assert rows[-1]["type"] == "run_finished"
    assert rows[-1]["reason"] == "duration"

    # the reports render from the torn, four-session journal, and say what the kills cost
    assert main(["report", str(out)]) in (0, 3)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    assert "journal check" not in printed.err
    assert "when 3 session(s) were killed" in printed.out
    assert "1 torn line(s) skipped" in printed.out
    assert (out / "report.html").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["requests"]["total"] == accounting.num_plans


def records_until_torn(out: Path) -> list[dict[str, object]]:
    """The journal's whole records (a torn line is skipped, as the reader skips it)."""
    rows = []
    for line in (out / "journal.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
