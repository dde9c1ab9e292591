"""Frames: one row per plan joined with its observation, findings, aggregates; streaming."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import run_journals

from kvcanary.harness.record.events import Event, ObservationRecorded, PlanRecorded
from kvcanary.harness.record.journal import read_journal
from kvcanary.reports import frames as frames_module
from kvcanary.reports.frames import frames_from_events, load_frames
from kvcanary.reports.tables import size_table, tenant_table


def test_requests_join_plans_with_observations(record: Callable[[str], Path]) -> None:
    frames = load_frames(record("vulnerable"))
    requests = frames.requests.set_index("request_id")
    assert len(requests) == 14
    assert requests.index.is_unique
    probe = requests.loc["run-vuln-mallory-000013"]
    assert probe["tenant"] == "mallory"
    assert probe["intent"] == "probe"
    assert probe["expected"] == "reject"
    assert probe["size_label"] == "above-pool"
    assert probe["status"] == 200
    assert probe["ok"]
    assert probe["outcome"] == "accepted"
    assert probe["num_prompt_tokens"] == 6000
    assert probe["prompt_tokens"] == 1
    assert probe["ttft_ms"] == pytest.approx(3.0)
    assert probe["pool_ratio"] == pytest.approx(6000 / 4096)
    assert probe["context_ratio"] == pytest.approx(6000 / 8192)
    rejected = requests.loc["run-vuln-bob-000014"]
    assert rejected["outcome"] == "rejected"
    assert rejected["error_kind"] == "http_status"
    assert pd.isna(rejected["ttft_ms"])
    assert "text" not in frames.requests.columns  # response text never enters a report


def test_findings_frame_has_one_row_per_finding(record: Callable[[str], Path]) -> None:
    findings = load_frames(record("vulnerable")).findings
    assert list(findings["kind"].astype(str)) == [
        "cross_tenant_canary",
        "unsafe_accept",
        "prompt_tokens_mismatch",
        "fast_prefill",
    ]
    leak = findings.iloc[0]
    assert leak["victim_tenant"] == "alice"
    assert leak["tenant"] == "mallory"
    assert leak["offset_end"] - leak["offset_start"] == len(leak["marker"])


def test_planned_but_unanswered_requests_are_kept(record: Callable[[str], Path]) -> None:
    frames = load_frames(record("interrupted"))
    assert frames.finished is not None
    assert frames.finished.reason == "interrupted"
    outcomes = frames.requests.set_index("tenant")["outcome"]
    assert outcomes["alice"] == "accepted"
    assert outcomes["bob"] == "unanswered"
    assert not frames.requests.set_index("tenant").loc["bob", "answered"]


def test_aggregates_count_outcomes_and_findings(record: Callable[[str], Path]) -> None:
    frames = load_frames(record("vulnerable"))
    tenants = tenant_table(frames)
    assert tenants.loc["mallory", "num_findings"] == 4
    assert tenants.loc["alice", "num_findings_as_victim"] == 1
    assert tenants.loc["bob", "num_rejected"] == 1
    assert tenants["num_requests"].sum() == 14
    sizes = size_table(frames)
    assert list(sizes.index) == ["small", "medium", "large", "above-pool", "above-context"]
    assert sizes.loc["above-pool", "num_accepted"] == 1
    assert sizes.loc["above-pool", "num_findings"] == 4
    assert sizes.loc["above-context", "expected"] == "reject"


def test_many_chunks_give_the_same_frames(
    record: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = record("vulnerable")
    whole = load_frames(run_dir)
    monkeypatch.setattr(frames_module, "CHUNK_ROWS", 3)  # every dictionary differs per chunk
    chunked = load_frames(run_dir)
    pd.testing.assert_frame_equal(whole.requests, chunked.requests)
    pd.testing.assert_frame_equal(whole.findings, chunked.findings)


def test_plans_are_released_as_their_observations_arrive(record: Callable[[str], Path]) -> None:
    """The join holds only plans in flight: a plan is dropped once its observation is seen."""
    run_dir = record("vulnerable")
    in_flight: list[int] = []
    planned: set[str] = set()

    def tracked() -> Iterator[Event]:
        for event in read_journal(run_dir):
            if isinstance(event, PlanRecorded):
                planned.add(event.plan.request_id)
            elif isinstance(event, ObservationRecorded):
                planned.discard(event.observation.request_id)
            in_flight.append(len(planned))
            yield event

    frames = frames_from_events(tracked())
    assert max(in_flight) == 1
    assert len(frames.requests) == 14


def test_a_journal_cut_mid_line_still_loads(record: Callable[[str], Path]) -> None:
    run_dir = record("vulnerable")
    journal = run_dir / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # killed while writing run end
    with pytest.warns(UserWarning, match="truncated"):
        frames = load_frames(run_dir)
    assert frames.finished is None
    assert len(frames.findings) == 4


def test_an_empty_run_gives_empty_frames(tmp_path: Path) -> None:
    recorder = run_journals.RunRecorder(tmp_path, "run-empty")
    recorder.start(run_journals.TENANTS)
    recorder.finish("error", "target unreachable")
    frames = load_frames(tmp_path)
    assert frames.requests.empty
    assert frames.findings.empty
    assert tenant_table(frames).empty
    assert size_table(frames).empty
