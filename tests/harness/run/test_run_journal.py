"""The run's journal holds `run_finished` back until the run's last phase is over."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

from kvcanary.harness.record.events import PhaseStarted, RunFinished
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.run_journal import Journal


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def journal(out: Path) -> Journal:
    return Journal(out, ProgressDisplay(file=io.StringIO(), live=False))


def test_run_finished_is_written_when_the_run_ends_not_when_the_runner_does(
    tmp_path: Path,
) -> None:
    run = journal(tmp_path)
    runner_end = RunFinished("completed", time.time() - 5, 12)
    run.emit(runner_end)
    run.emit(PhaseStarted("cache_probe", time.time()))  # after the runner: before its end
    run.finish(num_more_requests=30, reason="interrupted")
    run.emit(RunFinished("completed", time.time(), 99))  # the run has ended: ignored
    run.close()

    first, last = rows(tmp_path)
    assert first["type"] == "phase"
    assert (last["type"], last["reason"], last["num_requests"]) == (
        "run_finished",
        "interrupted",
        42,
    )
    assert last["t_wall"] > runner_end.t_wall  # stamped when the run really ended


def test_close_writes_a_held_end_and_an_explicit_end_replaces_it(tmp_path: Path) -> None:
    held = journal(tmp_path / "held")
    held.emit(RunFinished("error", time.time(), 3, "boom"))
    held.close()
    assert [(r["type"], r["reason"]) for r in rows(tmp_path / "held")] == [
        ("run_finished", "error")
    ]

    given = journal(tmp_path / "given")
    given.emit(RunFinished("completed", time.time(), 3))  # a scenario step's runner
    given.finish(RunFinished("interrupted", time.time(), 7, "the run was cancelled"))
    given.close()
    (end,) = rows(tmp_path / "given")
    assert (end["reason"], end["num_requests"]) == ("interrupted", 7)


def test_a_run_that_never_finished_writes_no_end(tmp_path: Path) -> None:
    run = journal(tmp_path)
    run.emit(PhaseStarted("fill", time.time()))
    run.close()
    assert [r["type"] for r in rows(tmp_path)] == ["phase"]
