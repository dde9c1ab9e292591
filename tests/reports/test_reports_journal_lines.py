"""The vectorised pieces of the fast path: line chunks, line kinds, hashes, crosstab counts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from test_reports_journal_scan import _assert_same, _slow

from kvcanary.harness.record.events import ObservationRecorded, PlanRecorded
from kvcanary.harness.record.journal import read_journal
from kvcanary.reports import journal_lines, journal_pick, journal_scan, request_columns
from kvcanary.reports.frames import load_frames
from kvcanary.reports.tables import cross_counts


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_chunks_cut_exactly_the_lines_a_file_iterator_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    monkeypatch.setattr(journal_lines, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(7)
    lines = [b"x" * int(n) + b"\n" for n in rng.integers(0, 300, 200)]
    path = tmp_path / "lines"
    path.write_bytes(b"".join([*lines, b"\n", b"a last line without its newline"]))
    with path.open("rb") as handle:
        expected = list(handle)
    got = [chunk.line(i) for chunk in journal_lines.chunks(path) for i in range(len(chunk.starts))]
    assert got == expected
    data = path.read_bytes()
    for chunk in journal_lines.chunks(path):  # each chunk says where it is in the file
        assert (
            data[chunk.offset : chunk.offset + int(chunk.ends[-1])] == chunk.data[: chunk.ends[-1]]
        )
    cut = len(b"".join(lines)) - 5  # a partial read stops where it was told to
    assert (
        b"".join(
            chunk.line(i)
            for chunk in journal_lines.chunks(path, cut)
            for i in range(len(chunk.starts))
        )
        == b"".join(lines)[:cut]
    )


def test_line_kinds_are_the_two_request_prefixes_only(tmp_path: Path) -> None:
    path = tmp_path / "lines"
    lines = [
        b'{"type":"plan","request_id":"a"}\n',  # shorter than the window: checked one by one
        b'{"type":"observation","request_id":"' + b"b" * 50 + b'"}\n',
        b'{"type":"planX","request_id":"' + b"c" * 50 + b'"}\n',
        b'{"type":"finding","request_id":"' + b"d" * 50 + b'"}\n',
        b' {"type":"plan","request_id":"' + b"e" * 50 + b'"}\n',
        b"\n",
    ]
    path.write_bytes(b"".join(lines))
    (chunk,) = journal_lines.chunks(path)
    plan, observation, other = journal_lines.PLAN, journal_lines.OBSERVATION, journal_lines.OTHER
    assert chunk.kinds().tolist() == [plan, observation, other, other, other, other]
    assert chunk.well_ended().tolist() == [True] * 5 + [False]


def test_hashes_depend_on_the_bytes_only() -> None:
    rng = np.random.default_rng(3)
    values = [
        bytes(rng.integers(0, 256, int(n)).astype(np.uint8)) for n in rng.integers(0, 40, 3000)
    ]
    values += [b"", b"\0", b"\0\0", b"x" * 300, b"x" * 301, b"abcdefgh", b"abcdefgh\0"]
    one_by_one = [_hash([value])[0] for value in values]
    assert _hash(values).tolist() == one_by_one  # whatever else is hashed with them
    distinct = {value: h for value, h in zip(values, one_by_one, strict=True)}
    assert len(set(distinct.values())) == len(distinct)  # no collision among these
    ids = pa.array([value.hex() for value in values])  # Arrow's buffers give the same hashes
    assert (
        request_columns.id_hashes(ids.slice(5)).tolist()
        == _hash([value.hex().encode() for value in values[5:]]).tolist()
    )


def _hash(values: list[bytes]) -> np.ndarray:
    lengths = np.array([len(value) for value in values], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    data = np.frombuffer(b"".join(values), np.uint8)
    return journal_lines.hash_slices(data, starts, lengths)


def test_short_and_escaped_request_ids_are_joined_and_found(
    record: Callable[[str], Path],
) -> None:
    run_dir = record("vulnerable")
    journal = run_dir / "journal.jsonl"
    renamed: dict[str, str] = {}
    out = []
    for line in journal.read_bytes().splitlines():
        record_ = json.loads(line)
        if record_["type"] in ("plan", "observation"):
            old = record_["request_id"]
            new = renamed.setdefault(old, ["r", "é-", 'q"'][len(renamed) % 3] + str(len(renamed)))
            record_["request_id"] = new
            if isinstance(record_.get("observation"), dict):
                record_["observation"]["request_id"] = new
        elif record_["type"] == "finding":
            for key in ("request_id", "victim_request_id"):
                if record_.get(key) in renamed:
                    record_[key] = renamed[record_[key]]
        out.append(json.dumps(record_, separators=(",", ":")).encode() + b"\n")
    journal.write_bytes(b"".join(out))
    journal_scan.request_frame(run_dir)  # the fast path reads it
    _assert_same(load_frames(run_dir), _slow(run_dir))
    named = {"r0", "é-1", 'q"2', "r3" + "x"}
    expected = [
        e
        for e in read_journal(run_dir)
        if (isinstance(e, PlanRecorded) and e.plan.request_id in named)
        or (isinstance(e, ObservationRecorded) and e.observation.request_id in named)
    ]
    assert len(expected) == 6
    assert list(journal_pick.request_lines(run_dir, named)) == expected


def test_cross_counts_are_crosstab() -> None:
    rng = np.random.default_rng(1)
    for _ in range(100):
        n = int(rng.integers(0, 40))
        rows = pd.Series(
            pd.Categorical(rng.choice([*"abcde", None], n), categories=rng.permutation([*"abcde"])),
            name="size_label",
        )
        columns = pd.Series(
            pd.Categorical(rng.choice([*"pqrs", None], n), categories=rng.permutation([*"pqrs"])),
            name="outcome",
        )
        pd.testing.assert_frame_equal(cross_counts(rows, columns), pd.crosstab(rows, columns))
    plain = pd.Series(["a", "b"]), pd.Series(["p", "p"])  # not categorical: crosstab itself
    pd.testing.assert_frame_equal(cross_counts(*plain), pd.crosstab(*plain))
