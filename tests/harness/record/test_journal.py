"""The journal: append-only JSON Lines, segments, crash tolerance, permissions."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.span import CanarySpan
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    Limits,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    RunFinished,
    RunStarted,
)
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.journal import (
    RECORD_START,
    REQUEST_LINE_PREFIXES,
    JournalWarning,
    JournalWriter,
    encode_event,
    journal_segments,
    read_journal,
)
from kvcanary.harness.record.observation import Observation, Usage
from kvcanary.tenants.plan import RequestPlan


def plan(i: int = 1) -> RequestPlan:
    return RequestPlan(
        request_id=f"t0-r{i:06d}",
        tenant="tenant-0",
        phase="fill",
        intent="victim",
        size_label="fill",
        num_prompt_tokens=1000,
        expected="accept",
        api="chat",
        prompt="",  # journaled plans never carry the prompt
        canaries=(CanarySpan("cnry alpha beta", 0, 0, 0), CanarySpan("cnry gamma", 40, 9, 1)),
        prompt_sha256="ab" * 32,
    )


def observation(i: int = 1) -> Observation:
    return Observation(
        request_id=f"t0-r{i:06d}",
        tenant="tenant-0",
        status=200,
        t_wall=1.7e9,
        t_scheduled_ns=1,
        t_sent_ns=2,
        t_first_byte_ns=3,
        t_first_token_ns=4,
        t_done_ns=5,
        text="héllo \U0001f600 wörld",
        num_text_chars=14,
        num_chunks=3,
        usage=Usage(prompt_tokens=1000, completion_tokens=3, cached_tokens=0),
        finish_reason="stop",
    )


def finding() -> Finding:
    return Finding(
        kind=FindingKind.CROSS_TENANT_CANARY,
        severity=Severity.CRITICAL,
        detector="content",
        request_id="t1-r000002",
        tenant="tenant-1",
        summary="tenant-1's response contained tenant-0's canary",
        victim_tenant="tenant-0",
        victim_request_id="t0-r000001",
        marker="cnry alpha beta",
        offsets=(10, 25),
        excerpt="[…] cnry alpha beta […]",
        details={"layer": "exact", "num_markers": 2, "layers": ["exact"]},
    )


def every_event() -> list[Event]:
    return [
        RunStarted(
            run_id="run-1",
            target="http://127.0.0.1:1",
            model="m",
            api="chat",
            limits=Limits(2048, 4096, 16, "flags", max_input_tokens=4000),
            tenants=({"name": "tenant-0", "api_key_env": "KEY0"},),
            seed=7,
            canary_key_id="k1",
            settings={"concurrency": 8},
            versions={"kvcanary": "0.1.0"},
            t_wall=1.0,
        ),
        PhaseStarted("fill", 2.0),
        PlanRecorded(plan()),
        ObservationRecorded(observation()),
        FindingRecorded(finding(), t_wall=3.0),
        RunFinished("completed", 4.0, 1, message=None),
    ]


def test_every_event_type_round_trips(tmp_path: Path) -> None:
    with JournalWriter(tmp_path / "journal.jsonl") as journal:
        for event in every_event():
            journal.write(event)
    assert list(read_journal(tmp_path)) == every_event()


def test_every_line_starts_as_the_contract_declares() -> None:
    """Fast readers pick request lines by their declared prefix without parsing them."""
    for event in every_event():
        line = encode_event(event)
        assert line.startswith(RECORD_START)
        record_type = json.loads(line)["type"]
        if record_type in REQUEST_LINE_PREFIXES:
            assert line.startswith(REQUEST_LINE_PREFIXES[record_type])
    assert set(REQUEST_LINE_PREFIXES) == {"plan", "observation"}


def test_lines_are_strict_json_one_record_each(tmp_path: Path) -> None:
    weird = dataclasses.replace(
        finding(), details={"ratio": float("nan"), "kind": FindingKind.FAST_PREFILL, "t": (1, 2)}
    )
    with JournalWriter(tmp_path / "journal.jsonl") as journal:
        journal.write(FindingRecorded(weird, t_wall=1.0))
        journal.write(ObservationRecorded(dataclasses.replace(observation(), text="a\ud800b")))
    lines = (tmp_path / "journal.jsonl").read_bytes().splitlines()
    assert len(lines) == 2
    records = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON {c}")) for line in lines
    ]
    assert records[0]["details"] == {"ratio": None, "kind": "fast_prefill", "t": [1, 2]}
    [_, obs] = list(read_journal(tmp_path))
    assert isinstance(obs, ObservationRecorded)
    assert obs.observation.text == "a\ud800b"


def test_each_event_is_on_disk_as_soon_as_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = JournalWriter(path, fsync_interval_s=3600)
    journal.write(PhaseStarted("fill", 1.0))
    journal.write(PlanRecorded(plan()))
    # Read by another handle while the writer is still open (as after a SIGKILL).
    assert list(read_journal(path)) == [PhaseStarted("fill", 1.0), PlanRecorded(plan())]
    journal.close()
    journal.close()
    with pytest.raises(ValueError, match="closed"):
        journal.write(PhaseStarted("x", 1.0))


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("fill", 1.0))
        journal.write(PlanRecorded(plan()))
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"type":"observation","request_id":"t0-r0')
    with pytest.warns(JournalWarning, match="truncated last line"):
        events = list(read_journal(path))
    assert events == [PhaseStarted("fill", 1.0), PlanRecorded(plan())]


def test_resuming_after_a_torn_write_keeps_the_next_record_whole(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("fill", 1.0))
    with path.open("ab") as f:
        f.write(b'{"type":"pha')
    with JournalWriter(path) as journal:  # resume: append mode
        journal.write(PhaseStarted("probe", 2.0))
    with pytest.warns(JournalWarning, match="corrupt line"):
        events = list(read_journal(path))
    assert events == [PhaseStarted("fill", 1.0), PhaseStarted("probe", 2.0)]


def test_unknown_record_type_is_skipped_and_unknown_fields_are_dropped_with_a_warning(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("fill", 1.0))
    with path.open("a") as f:
        f.write('{"type":"hologram","x":1}\n')
        f.write('{"type":"phase","phase":"probe","t_wall":2.0,"from_the_future":1}\n')
        f.write('{"type":"phase","phase":"abort","t_wall":2.5,"from_the_future":2}\n')
        f.write("[1, 2]\n")
    with JournalWriter(path) as journal:
        journal.write(RunFinished("completed", 3.0, 0))
    with pytest.warns(JournalWarning) as caught:
        events = list(read_journal(path))
    assert events == [  # a newer kvcanary's field costs nothing but itself
        PhaseStarted("fill", 1.0),
        PhaseStarted("probe", 2.0),
        PhaseStarted("abort", 2.5),
        RunFinished("completed", 3.0, 0),
    ]
    messages = [str(w.message) for w in caught]
    assert any("'hologram'" in message for message in messages)
    assert sum("'phase.from_the_future'" in message for message in messages) == 1  # once
    assert any("not a journal record" in message for message in messages)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"[" * 100_000 + b"\n", "corrupt line"),  # deeper than Python's stack
        (b'{"type":"observation","request_id":"r","tenant":"a","status":' + b"1" + b"0" * 40
         + b',"t_wall":1.0,"t_scheduled_ns":1,"t_sent_ns":2}\n', "out of range"),
        (b'{"type":"run_finished","reason":"completed","t_wall":1e999,"num_requests":0}\n',
         "out of range"),
        (b'{"type":"phase","phase":"fill","t_wall":"soon"}\n', "expected float, got a string"),
        (b'{"type":"phase","phase":["fill"],"t_wall":1.0}\n', "expected str, got a list"),
        (b'{"type":"finding","t_wall":1.0,"kind":"vibes","severity":"high","detector":"d",'
         b'"request_id":null,"tenant":null,"summary":"s"}\n', "not a known value"),
        (b'{"type":"phase","t_wall":1.0}\n', "phase"),  # a required field missing
    ],
)  # fmt: skip
def test_a_hostile_line_is_skipped_with_one_warning(tmp_path: Path, line: bytes, why: str) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("fill", 1.0))
    with path.open("ab") as f:
        f.write(line)
    with JournalWriter(path) as journal:
        journal.write(RunFinished("completed", 3.0, 0))
    with pytest.warns(JournalWarning) as caught:
        events = list(read_journal(path))
    assert events == [PhaseStarted("fill", 1.0), RunFinished("completed", 3.0, 0)]
    [warning] = caught
    assert why in str(warning.message)


def test_a_run_start_of_the_wrong_schema_type_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("fill", 1.0))
    record = {
        "type": "run_started", "run_id": "r", "target": "t", "model": "m", "api": "chat",
        "limits": {"pool_tokens": 1, "context_tokens": 2, "page_size": 16, "source": "flags"},
        "tenants": [], "seed": 1, "canary_key_id": "k", "schema": "2",
    }  # fmt: skip
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    with pytest.warns(JournalWarning, match="schema: expected int, got a string"):
        assert list(read_journal(path)) == [PhaseStarted("fill", 1.0)]


def test_rotation_names_segments_and_reads_them_in_order(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("a", 1.0))
        first = journal.rotate()
        journal.write(PhaseStarted("b", 2.0))
        second = journal.rotate()
        journal.write(PhaseStarted("c", 3.0))
        assert journal.segments() == [first, second, path]
    assert (first.name, second.name) == ("journal.0001.jsonl", "journal.0002.jsonl")
    assert [e.phase for e in read_journal(tmp_path)] == ["a", "b", "c"]  # type: ignore[union-attr]
    # A resumed writer continues the numbering.
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("d", 4.0))
        assert journal.rotate().name == "journal.0003.jsonl"
    assert [e.phase for e in read_journal(path)] == ["a", "b", "c", "d"]  # type: ignore[union-attr]


def test_segments_sort_numerically_past_9999(tmp_path: Path) -> None:
    for name in ("journal.10000.jsonl", "journal.9999.jsonl", "journal.jsonl"):
        (tmp_path / name).write_text("")
    names = [p.name for p in journal_segments(tmp_path)]
    assert names == ["journal.9999.jsonl", "journal.10000.jsonl", "journal.jsonl"]


def test_automatic_rotation_by_size(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path, max_segment_bytes=1000) as journal:
        for i in range(20):
            journal.write(PlanRecorded(plan(i)))
        segments = journal.segments()
    assert len(segments) > 3
    assert all(p.stat().st_size <= 1000 for p in segments)
    events = list(read_journal(tmp_path))
    assert [e.plan.request_id for e in events] == [  # type: ignore[union-attr]
        f"t0-r{i:06d}" for i in range(20)
    ]


async def test_concurrent_writers_keep_lines_whole(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    big = dataclasses.replace(observation(), text="x" * 100_000)

    async def task(n: int) -> None:
        for i in range(20):
            obs = dataclasses.replace(big, request_id=f"t{n}-r{i:06d}")
            if i % 2:  # half from worker threads, where the lock is what keeps lines whole
                await asyncio.to_thread(journal.write, ObservationRecorded(obs))
            else:
                journal.write(ObservationRecorded(obs))
            await asyncio.sleep(0)

    with JournalWriter(path) as journal:
        await asyncio.gather(*(task(n) for n in range(8)))
    events = list(read_journal(path))
    assert len(events) == 160
    assert {e.observation.request_id for e in events} == {  # type: ignore[union-attr]
        f"t{n}-r{i:06d}" for n in range(8) for i in range(20)
    }
    assert all(e.observation.text == big.text for e in events)  # type: ignore[union-attr]


def test_writes_from_threads_interleave_only_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with JournalWriter(path, max_segment_bytes=200_000) as journal:

        def worker(n: int) -> None:
            for i in range(25):
                obs = dataclasses.replace(observation(), request_id=f"{n}-{i}", text="y" * 9000)
                journal.write(ObservationRecorded(obs))

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(list(read_journal(tmp_path))) == 100


def test_journal_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "run" / "journal.jsonl"
    with JournalWriter(path) as journal:
        journal.write(PhaseStarted("fill", 1.0))
        rotated = journal.rotate()
        journal.write(PhaseStarted("probe", 2.0))
    for p in (path, rotated):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    os.chmod(path, 0o644)
    with JournalWriter(path):
        pass
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_missing_journal_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no journal"):
        list(read_journal(tmp_path))
    with pytest.raises(ConfigError):
        JournalWriter(tmp_path / "journal.jsonl", fsync_interval_s=-1)
