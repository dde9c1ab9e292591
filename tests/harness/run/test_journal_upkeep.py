"""A soak's journal upkeep: the resume checkpoint, gzipped segments, the retention."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from kvcanary.harness.record.events import (
    FindingRecorded,
    ObservationRecorded,
    PlanRecorded,
    RunStarted,
)
from kvcanary.harness.record.journal import JournalWriter, closed_segments, read_journal
from kvcanary.harness.run import journal_upkeep
from kvcanary.harness.run.journal_upkeep import JournalUpkeep
from kvcanary.harness.run.option_values import parse_retention, retention_limits
from kvcanary.harness.run.resume_state import CHECKPOINT_NAME, ResumeState

sys.path.insert(0, str(Path(__file__).parents[1] / "record"))
from test_journal import every_event, finding, observation, plan


def started(t_wall: float) -> RunStarted:
    first = every_event()[0]
    assert isinstance(first, RunStarted)
    return dataclasses.replace(first, t_wall=t_wall)


def soak_session(run_dir: Path, first: int, num: int, t0: float, *, rotate_every: int) -> None:
    """One soak session: run_started, then `num` requests, rotated every `rotate_every`."""
    upkeep = JournalUpkeep(run_dir, None)
    with JournalWriter(run_dir / "journal.jsonl") as journal:

        def write(event: object) -> None:
            journal.write(event)  # type: ignore[arg-type]
            upkeep.feed(event)  # type: ignore[arg-type]

        write(started(t0))
        for i in range(first, first + num):
            write(PlanRecorded(plan(i)))
            write(ObservationRecorded(dataclasses.replace(observation(i), t_wall=t0 + i)))
            if (i + 1) % rotate_every == 0:
                asyncio.run(upkeep.closed(journal.rotate()))


def full_fold(run_dir: Path) -> ResumeState:
    state = ResumeState()
    for event in read_journal(run_dir):
        state.feed(event)
    return state


def test_the_checkpoint_resumes_as_reading_every_segment_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_upkeep, "COMPRESS_AFTER_S", -1.0)  # gzip every closed one
    soak_session(tmp_path, 0, 25, 1000.0, rotate_every=10)
    soak_session(tmp_path, 25, 17, 5000.0, rotate_every=10)
    assert [p.name for _, p in closed_segments(tmp_path)] == [
        f"journal.000{n}.jsonl.gz" for n in range(1, 5)
    ]
    assert json.loads((tmp_path / CHECKPOINT_NAME).read_text())["segment"] == 4
    resumed, whole = ResumeState.load(tmp_path), full_fold(tmp_path)
    assert resumed.to_dict() == whole.to_dict()
    assert (resumed.num_plans, resumed.next_request) == (42, 42)
    assert resumed.elapsed_s == pytest.approx(24 + 41)  # each session to its latest t_wall


@pytest.mark.parametrize(
    "damage", ["", "{", '{"version": 1, "segment": 99, "state": {}}', '{"version": 7}']
)
def test_a_bad_checkpoint_is_ignored_and_the_journal_read_whole(
    tmp_path: Path, damage: str
) -> None:
    soak_session(tmp_path, 0, 25, 1000.0, rotate_every=10)
    (tmp_path / CHECKPOINT_NAME).write_text(damage)
    assert ResumeState.load(tmp_path).to_dict() == full_fold(tmp_path).to_dict()


def test_retention_keeps_the_start_and_segments_with_findings(tmp_path: Path) -> None:
    upkeep = JournalUpkeep(tmp_path, "1B")  # delete whatever the rules allow
    with JournalWriter(tmp_path / "journal.jsonl") as journal:

        def write(event: object) -> None:
            journal.write(event)  # type: ignore[arg-type]
            upkeep.feed(event)  # type: ignore[arg-type]

        write(started(1.0))
        deleted = []
        for i in range(8):
            write(PlanRecorded(plan(i)))
            if i == 3:
                write(FindingRecorded(finding(), t_wall=2.0))
            deleted += asyncio.run(upkeep.closed(journal.rotate()))
    left = [n for n, _ in closed_segments(tmp_path)]
    assert left == [1, 4, 8]  # the start, the finding, the newest
    assert sorted(p.name for p in deleted) == [f"journal.000{n}.jsonl" for n in (2, 3, 5, 6, 7)]
    assert ResumeState.load(tmp_path).num_plans == 8  # the checkpoint covers what is gone


def test_closed_segments_stay_plain_until_they_are_old(tmp_path: Path) -> None:
    soak_session(tmp_path, 0, 20, 1000.0, rotate_every=10)
    first = tmp_path / "journal.0001.jsonl"
    assert first.exists()  # a fresh one stays plain, for tail and grep
    old = time.time() - journal_upkeep.COMPRESS_AFTER_S - 60
    os.utime(first, (old, old))
    soak_session(tmp_path, 20, 10, 2000.0, rotate_every=10)
    assert [p.name for _, p in closed_segments(tmp_path)] == [
        "journal.0001.jsonl.gz",
        "journal.0002.jsonl",
        "journal.0003.jsonl",
    ]
    assert ResumeState.load(tmp_path).num_plans == 30


def test_retention_values() -> None:
    assert retention_limits(parse_retention("24h")) == (86400.0, None)
    assert retention_limits(parse_retention("500MB")) == (None, 500_000_000)
    assert retention_limits(None) == (None, None)
    for bad in ("0GB", "soon", "-1d", "12 parsecs"):
        with pytest.raises(ValueError, match="expected"):
            parse_retention(bad)
