"""Closed segments: gzipped, read back the same by every reader, pruned by the retention."""

from __future__ import annotations

import os
import time
from pathlib import Path

from test_journal import every_event, finding, observation, plan

from kvcanary.harness.record.events import FindingRecorded, ObservationRecorded, PlanRecorded
from kvcanary.harness.record.journal import JournalWriter, closed_segments, read_journal
from kvcanary.harness.record.segments import (
    compress_segment,
    holds_a_finding,
    open_segment,
    prune,
    segment_size,
)


def three_segments(tmp_path: Path) -> list[Path]:
    with JournalWriter(tmp_path / "journal.jsonl") as journal:
        for event in every_event():
            journal.write(event)
        first = journal.rotate()
        for i in range(2, 40):
            journal.write(PlanRecorded(plan(i)))
            journal.write(ObservationRecorded(observation(i)))
        second = journal.rotate()
        journal.write(FindingRecorded(finding(), t_wall=9.0))
    return [first, second, tmp_path / "journal.jsonl"]


def test_compressed_segments_read_back_as_the_same_events(tmp_path: Path) -> None:
    first, second, _ = three_segments(tmp_path)
    plain = list(read_journal(tmp_path))
    sizes = [first.stat().st_size, second.stat().st_size]
    first_bytes = first.read_bytes()
    compressed = [compress_segment(first), compress_segment(second)]
    assert [p.name for p in compressed] == ["journal.0001.jsonl.gz", "journal.0002.jsonl.gz"]
    assert not first.exists()
    assert not second.exists()
    assert [segment_size(p) for p in compressed] == sizes
    assert [os.stat(p).st_mode & 0o777 for p in compressed] == [0o600, 0o600]
    assert list(read_journal(tmp_path)) == plain
    assert [n for n, _ in closed_segments(tmp_path)] == [1, 2]
    with open_segment(compressed[0]) as f:
        f.seek(10)  # readers seek forward
        assert f.read(5) == first_bytes[10:15]
    assert list(read_journal(tmp_path, after=1)) == plain[len(every_event()) :]


def test_a_crash_during_compression_leaves_the_plain_segment_read(tmp_path: Path) -> None:
    first, _, _ = three_segments(tmp_path)
    plain = list(read_journal(tmp_path))
    partial = first.with_name(first.name + ".gz.partial")
    partial.write_bytes(b"half a gzip")  # killed while writing: not a segment
    assert list(read_journal(tmp_path)) == plain
    both = first.with_name(first.name + ".gz")
    both.write_bytes(b"not even gzip")  # killed after the rename: the plain one is read
    assert list(read_journal(tmp_path)) == plain


def test_findings_are_found_in_plain_and_compressed_segments(tmp_path: Path) -> None:
    first, second, current = three_segments(tmp_path)
    assert holds_a_finding(first)  # every_event() holds one
    assert not holds_a_finding(second)
    assert holds_a_finding(current)
    assert holds_a_finding(compress_segment(first))
    assert not holds_a_finding(compress_segment(second))


def test_retention_deletes_oldest_first_but_keeps_the_start_findings_and_the_newest(
    tmp_path: Path,
) -> None:
    segments = []
    for number in range(1, 7):
        path = tmp_path / f"journal.{number:04d}.jsonl.gz"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - 3600 * (7 - number),) * 2)
        segments.append((number, path))
    deleted = prune(segments, max_age_s=2.5 * 3600, max_bytes=None, keep=lambda n, _: n == 3)
    assert [p.name for p in deleted] == ["journal.0002.jsonl.gz", "journal.0004.jsonl.gz"]
    left = [(n, p) for n, p in segments if p.exists()]
    deleted = prune(left, max_age_s=None, max_bytes=2500, keep=lambda n, _: False)
    assert [p.name for p in deleted] == ["journal.0003.jsonl.gz", "journal.0005.jsonl.gz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "journal.0001.jsonl.gz",
        "journal.0006.jsonl.gz",
    ]
