"""The fast journal path gives exactly the frames the event-by-event reader gives."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import run_journals

from kvcanary.harness.record.events import ObservationRecorded, PlanRecorded
from kvcanary.harness.record.journal import JournalWarning, read_journal
from kvcanary.reports import journal_lines, journal_pick, journal_scan
from kvcanary.reports.frames import RunFrames, frames_from_events, load_frames


def _slow(run_dir: Path) -> RunFrames:
    return frames_from_events(read_journal(run_dir))


def _assert_same(fast: RunFrames, slow: RunFrames) -> None:
    pd.testing.assert_frame_equal(fast.requests, slow.requests)
    pd.testing.assert_frame_equal(fast.findings, slow.findings)
    for field in dataclasses.fields(RunFrames):
        if field.name not in ("requests", "findings"):
            assert getattr(fast, field.name) == getattr(slow, field.name), field.name


def _mixed_run(run_dir: Path) -> Path:
    """Every outcome, a lost plan, and a plan never answered, over two journal segments."""
    recorder = run_journals.RunRecorder(run_dir, "run-mixed")
    recorder.start(run_journals.TENANTS)
    recorder.phase("fill")
    common = {"phase": "fill", "intent": "victim", "size_label": "small", "expected": "accept"}
    recorder.request("alice", num_prompt_tokens=512, prompt_tokens=512, **common)  # type: ignore[arg-type]
    recorder.request("bob", num_prompt_tokens=600, status=503, error_kind="http_status", **common)  # type: ignore[arg-type]
    recorder.writer.rotate()
    recorder.request("bob", num_prompt_tokens=700, status=None, error_kind="connect", **common)  # type: ignore[arg-type]
    recorder.request(
        "mallory",
        num_prompt_tokens=800,
        status=200,
        error_kind="disconnected",
        **common,  # type: ignore[arg-type]
    )
    recorder.request("alice", num_prompt_tokens=900, status=None, error_kind="cancelled", **common)  # type: ignore[arg-type]
    lost = recorder.request("bob", num_prompt_tokens=1000, answered=False, **common)  # type: ignore[arg-type]
    orphan = recorder.request("mallory", num_prompt_tokens=1100, **common)  # type: ignore[arg-type]
    assert orphan.observation is not None
    recorder.writer.write(
        ObservationRecorded(dataclasses.replace(orphan.observation, request_id="run-mixed-lost"))
    )
    assert lost.observation is None
    recorder.finish("completed")
    return run_dir


@pytest.mark.parametrize("scenario", ["vulnerable", "clean", "interrupted", "unreachable"])
def test_the_fast_path_reads_every_scenario_exactly(
    record: Callable[[str], Path], scenario: str
) -> None:
    run_dir = record(scenario)
    _assert_same(load_frames(run_dir), _slow(run_dir))


def test_the_fast_path_reads_every_outcome_and_lost_records(tmp_path: Path) -> None:
    run_dir = _mixed_run(tmp_path / "mixed")
    journal_scan.request_frame(run_dir)  # readable by the fast path: no fallback hides here
    fast = load_frames(run_dir)
    _assert_same(fast, _slow(run_dir))
    outcomes = fast.requests.set_index("request_id")["outcome"].astype(str)
    assert set(outcomes) == {"accepted", "rejected", "errored", "disconnected", "unanswered"}
    assert outcomes["run-mixed-lost"] == "accepted"  # its plan was lost; its tenant kept
    assert fast.requests.set_index("request_id").loc["run-mixed-lost", "tenant"] == "mallory"


def test_the_fast_path_is_used_on_a_sound_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = run_journals.synthetic_run(tmp_path / "synthetic", 3_000, leak_every=50)
    monkeypatch.setattr(journal_scan, "BLOCK_BYTES", 64 << 10)  # many blocks
    monkeypatch.setattr(journal_scan, "MERGE_ROWS", 500)  # merged a few at a time
    monkeypatch.setattr(journal_lines, "CHUNK_BYTES", 100 << 10)  # many chunks
    read: list[int] = []
    real = journal_scan.request_frame

    def counted(*args: object) -> object:
        frame = real(*args)  # type: ignore[arg-type]
        read.append(len(frame))
        return frame

    monkeypatch.setattr("kvcanary.reports.frames.request_frame", counted)
    _assert_same(load_frames(run_dir), _slow(run_dir))
    assert read == [3_000]  # the fast path read it, and did not fall back


def test_a_damaged_journal_falls_back_to_the_careful_reader(tmp_path: Path) -> None:
    run_dir = run_journals.clean_run(tmp_path / "clean")
    journal = run_dir / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join([*lines[:5], b'{"type":"plan","request_id":"torn\n', *lines[5:]]))
    with pytest.raises(journal_scan.SlowPathNeeded):
        journal_scan.rare_events(run_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = load_frames(run_dir)
    assert any(issubclass(w.category, JournalWarning) for w in caught)
    assert len(fast.requests) == 14


def test_a_request_planned_twice_falls_back(tmp_path: Path) -> None:
    run_dir = run_journals.clean_run(tmp_path / "clean")
    first_plan = next(e for e in read_journal(run_dir) if isinstance(e, PlanRecorded))
    with (run_dir / "journal.jsonl").open("ab") as handle:
        from kvcanary.harness.record.journal import encode_event

        handle.write(encode_event(first_plan))
    with pytest.raises(journal_scan.SlowPathNeeded, match="planned twice"):
        journal_scan.request_frame(run_dir)
    _assert_same(load_frames(run_dir), _slow(run_dir))


def test_request_lines_decodes_only_the_named_requests(record: Callable[[str], Path]) -> None:
    run_dir = record("vulnerable")
    named = {"run-vuln-mallory-000013", "run-vuln-alice-000011"}
    events = list(journal_pick.request_lines(run_dir, named))
    assert len(events) == 4  # a plan and an observation each
    assert {
        e.plan.request_id if isinstance(e, PlanRecorded) else e.observation.request_id
        for e in events
        if isinstance(e, PlanRecorded | ObservationRecorded)
    } == named


def test_lines_not_written_compactly_are_still_found(record: Callable[[str], Path]) -> None:
    run_dir = record("vulnerable")
    journal = run_dir / "journal.jsonl"
    spaced = [
        json.dumps(json.loads(line)).encode() + b"\n"  # ", " and ": " separators
        for line in journal.read_bytes().splitlines()
    ]
    journal.write_bytes(b"".join(spaced))
    named = {"run-vuln-mallory-000013"}
    assert len(list(journal_pick.request_lines(run_dir, named))) == 2
    _assert_same(load_frames(run_dir), _slow(run_dir))


def _from_a_newer_kvcanary(run_dir: Path, *, schema: int) -> Path:
    """The incident run as a newer kvcanary might write it: a field it added to every plan,
    observation and finding (and to the nested usage), and its schema number."""
    run_journals.vulnerable_run(run_dir)
    journal = run_dir / "journal.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    for record in records:
        if record["type"] in ("plan", "observation", "finding"):
            record["priority"] = 3
        if record["type"] == "observation":
            record["usage"]["reasoning_tokens"] = 0
        if record["type"] == "run_started":
            record["schema"] = schema
    journal.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    return run_dir


@pytest.mark.parametrize("schema", [1, 2])  # 1: the fast path reads it; 2: event by event
def test_unknown_fields_keep_their_records_with_one_warning_each(
    tmp_path: Path, schema: int
) -> None:
    run_dir = _from_a_newer_kvcanary(tmp_path / "newer", schema=schema)
    with pytest.warns(JournalWarning) as caught:
        frames = load_frames(run_dir)
    reference = load_frames(run_journals.vulnerable_run(tmp_path / "same"))
    pd.testing.assert_frame_equal(frames.requests, reference.requests)
    assert list(frames.findings["kind"]) == list(reference.findings["kind"])
    unknown = [str(w.message) for w in caught if "is not known" in str(w.message)]
    named = sorted(message.split("'")[1] for message in unknown)
    assert named == [  # each once, not once per line
        "finding.priority",
        "observation.priority",
        "observation.usage.reasoning_tokens",
        "plan.priority",
    ]
