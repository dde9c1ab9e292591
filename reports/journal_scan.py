"""The fast way through a large journal: plans and observations parsed by Arrow, in C++.

A run of a million requests journals two million plan and observation lines. Turning each
into an event object (`harness.record.journal.read_journal`) costs tens of seconds; the
report needs only a few plain fields of each. So:

- one cheap pass over the lines (no JSON parsing; numpy over large chunks, see
  `reports.journal_lines`) sets aside the few lines that are not plans or observations
  (run start and end, phases, findings, probe verdicts, timing fits), which are then
  decoded as events in the ordinary way, and notes where they lie;
- `pyarrow.json` parses the plan and observation lines (read in large spans around those
  others) in blocks against an explicit schema of just the fields the request table uses
  (response text, hashes and canary text are skipped unread), and each few blocks are cut
  down to compact columns right away;
- plans are joined to their observations by a hash of the request id computed from
  Arrow's buffers, vectorised, every match then checked against the ids.

Anything this path is not sure to read exactly as `read_journal` would (a corrupt or torn
line, a record that does not decode, a journal from a newer schema, a request id planned or
observed twice) raises `SlowPathNeeded`, and `reports.frames` falls back to the event-by-event
reader, which skips damage with a warning. `request_lines` is the same idea for the evidence
pass: only lines whose request id a finding names are decoded (found by the id's bytes,
a chunk at a time).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from kvcanary.harness.record.events import (
    SCHEMA_VERSION,
    Event,
    ObservationRecorded,
    PlanRecorded,
    RunStarted,
    from_record,
)
from kvcanary.harness.record.journal import journal_segments
from kvcanary.reports.allocator import release_free_memory
from kvcanary.reports.journal_lines import (
    OBSERVATION,
    OTHER,
    PLAN,
    REQUEST_PREFIXES,
    Chunk,
    chunks,
    hash_slices,
)

_RECORD_START = b'{"type":"'
"""How `harness.record.journal.encode_event` starts every line (compact, `type` first)."""
BLOCK_BYTES = 1 << 20
"""Arrow's parse block: small blocks keep the reader's buffers small."""
MAX_ERROR_CHARS = 200
"""An observation's error text is cut to this many characters in the request table."""
DELIBERATE_ERRORS = ("disconnected", "cancelled")
"""Error kinds of requests the harness ended itself: an abort plan doing its job, Ctrl-C."""

_S, _I, _F, _B = pa.string(), pa.int64(), pa.float64(), pa.bool_()
_LINE_SCHEMA = pa.schema(
    [
        ("type", _S),
        ("request_id", _S),
        ("tenant", _S),
        ("phase", _S),
        ("intent", _S),
        ("size_label", _S),
        ("expected", _S),
        ("api", _S),
        ("num_prompt_tokens", _I),
        ("max_tokens", _I),
        ("canaries", pa.list_(pa.struct([("index", _I)]))),
        ("status", _I),
        ("t_wall", _F),
        ("t_scheduled_ns", _I),
        ("t_sent_ns", _I),
        ("t_first_token_ns", _I),
        ("t_done_ns", _I),
        ("text_redacted", _B),
        ("num_text_chars", _I),
        ("num_chunks", _I),
        (
            "usage",
            pa.struct([("prompt_tokens", _I), ("completion_tokens", _I), ("cached_tokens", _I)]),
        ),
        ("finish_reason", _S),
        ("error_kind", _S),
        ("error", _S),
    ]
)
_PLAN_COLUMNS = ("tenant", "phase", "intent", "size_label", "expected", "api")


class SlowPathNeeded(Exception):
    """This journal must be read event by event (see the module docstring)."""


@dataclass(frozen=True)
class JournalScan:
    """What one cheap pass over a journal's raw lines found."""

    events: list[Event]
    """Every event that is not a plan or an observation, in journal order."""
    longest_line: int
    """The longest line in bytes (a parse block must hold a whole line)."""
    segments: tuple[tuple[Path, int], ...]
    """Each segment and how many bytes of it were read: the request pass reads no more, so
    a journal still being written gives both passes the same lines."""
    num_plans: int
    num_observations: int
    others: tuple[tuple[tuple[int, int], ...], ...]
    """Per segment, the byte ranges (start, end) of its lines that are not plans or
    observations (the events above, blank lines): the request pass skips them unread."""


def rare_events(run_dir: Path) -> JournalScan:
    """One pass over the raw lines: the rare events decoded, the request lines counted."""
    events: list[Event] = []
    segments: list[tuple[Path, int]] = []
    others: list[tuple[tuple[int, int], ...]] = []
    longest = num_plans = num_observations = 0
    for segment in journal_segments(run_dir):
        size = 0
        ranges: list[tuple[int, int]] = []
        for chunk in chunks(segment):
            size = chunk.offset + int(chunk.ends[-1])
            longest = max(longest, int((chunk.ends - chunk.starts).max()))
            kinds = chunk.kinds()
            requests = (kinds != OTHER) & chunk.well_ended()
            num_plans += int(np.count_nonzero(kinds[requests] == PLAN))
            num_observations += int(np.count_nonzero(kinds[requests] == OBSERVATION))
            for index in np.flatnonzero(~requests).tolist():
                line = chunk.line(index)
                start = chunk.offset + int(chunk.starts[index])
                ranges.append((start, start + len(line)))
                if not line.endswith(b"}\n"):
                    if line.strip():
                        raise SlowPathNeeded(f"{segment.name}: a torn or corrupt line")
                    continue
                events.append(_decode(line))
        segments.append((segment, size))
        others.append(tuple(ranges))
    return JournalScan(events, longest, tuple(segments), num_plans, num_observations, tuple(others))


_QUOTE = ord('"')


def request_lines(run_dir: Path, request_ids: set[str]) -> Iterator[Event]:
    """The plan and observation events of the given requests (one pass, few decodes).

    A request line is picked by its id's bytes where the line writes it (right after the
    prefix), a chunk of lines at a time: the id's last eight bytes and its closing quote
    are compared for every line at once, then the few lines left are compared in full and
    decoded. Lines not written the way `encode_event` writes are decoded to be sure. An
    event is yielded only if its decoded request id is one of `request_ids`."""
    wanted: dict[int, set[bytes]] = {}
    for request_id in request_ids:
        # as `encode_event` writes it (ASCII, escaped), or as plain UTF-8
        for written in (json.dumps(request_id)[1:-1].encode("ascii"), request_id.encode()):
            wanted.setdefault(len(written), set()).add(written)
    tails = {length: _tail_words(needles) for length, needles in wanted.items()}
    for segment in journal_segments(run_dir):
        for chunk in chunks(segment):
            for index in _picked(chunk, wanted, tails):
                event = _decode(chunk.line(index))
                if _request_id(event) in request_ids:
                    yield event


_QUOTE = ord('"')
_TAIL = 8


def _tail_words(needles: set[bytes]) -> npt.NDArray[np.uint64]:
    """The last (up to) eight bytes of each needle, as the words `_tails` reads."""
    tails = [needle[-_TAIL:].rjust(_TAIL, b"\0") for needle in needles]
    return np.sort(np.frombuffer(b"".join(tails), "<u8"))


def _tails(array: npt.NDArray[np.uint8], ends: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """The eight bytes before each end (at least eight bytes in) as a word."""
    windows = np.lib.stride_tricks.sliding_window_view(array, _TAIL)
    words: npt.NDArray[np.uint64] = windows[ends - _TAIL].view("<u8")[:, 0]
    return words


def _picked(
    chunk: Chunk, wanted: dict[int, set[bytes]], tails: dict[int, npt.NDArray[np.uint64]]
) -> list[int]:
    """The lines of `chunk` whose request id is one of `wanted` (by length), and the lines
    not written the way `encode_event` writes, in order."""
    kinds = chunk.kinds()
    array = chunk.array
    picked: list[int] = []
    for kind, prefix in zip((PLAN, OBSERVATION), REQUEST_PREFIXES, strict=True):
        lines = np.flatnonzero(kinds == kind)
        id_starts = chunk.starts[lines] + len(prefix)
        for length, needles in wanted.items():
            fits = id_starts + length < chunk.ends[lines]  # with room for the closing quote
            candidates, id_ends = lines[fits], id_starts[fits] + length
            closed = array[id_ends] == _QUOTE
            candidates, id_ends = candidates[closed], id_ends[closed]
            tail = _tails(array, id_ends)
            if length < _TAIL:  # only the id's bytes count: the word's high bytes
                tail &= np.uint64(((1 << 64) - 1) ^ ((1 << (8 * (_TAIL - length))) - 1))
            found = candidates[np.isin(tail, tails[length])].tolist()
            for index in found:
                start = int(chunk.starts[index]) + len(prefix)
                if bytes(chunk.data[start : start + length]) in needles:
                    picked.append(index)
    for index in np.flatnonzero(kinds == OTHER).tolist():
        line = chunk.line(index)
        if not line.startswith(_RECORD_START) and line.strip():
            picked.append(index)
    return sorted(set(picked))


def _request_id(event: Event) -> str | None:
    if isinstance(event, PlanRecorded):
        return event.plan.request_id
    if isinstance(event, ObservationRecorded):
        return event.observation.request_id
    return None


def _decode(line: bytes) -> Event:
    try:
        event = from_record(json.loads(line))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SlowPathNeeded(f"a record that does not decode: {exc}") from exc
    if isinstance(event, RunStarted) and event.schema > SCHEMA_VERSION:
        raise SlowPathNeeded("a journal from a newer schema")
    return event


def request_frame(run_dir: Path, scan: JournalScan | None = None) -> pd.DataFrame:
    """One row per planned or observed request, columns as `reports.frames.REQUEST_SCHEMA`
    (without the limit ratios): observations in journal order, then unanswered plans.

    The columns are numpy arrays sized from the line counts of `scan` and filled block by
    block as Arrow parses (string columns as codes into one category list per column), so
    Arrow holds one block at a time besides the request ids, and no joined table exists:
    the observations keep their order, only the plan columns are gathered by each
    observation's plan, and each array becomes a pandas column as it is."""
    scan = scan if scan is not None else rare_events(run_dir)
    codes = _Codes()
    plans = _Filled(_PLAN_KINDS, scan.num_plans)
    observations = _Filled(_OBSERVATION_KINDS, scan.num_observations)
    options = pa_json.ParseOptions(explicit_schema=_LINE_SCHEMA, unexpected_field_behavior="ignore")
    # One thread and small blocks: every block in flight costs its buffers. The small
    # record batches they give (only the schema's fields) are merged before the columns
    # are cut from them, so each compute call works on many rows.
    size = max(BLOCK_BYTES, 2 * scan.longest_line)
    block = pa_json.ReadOptions(block_size=size, use_threads=False)
    pending: list[pa.RecordBatch] = []

    def add_pending() -> None:
        batch = pa.concat_batches(pending)
        pending.clear()
        plans.add(_plans(batch, codes))
        observations.add(_observations(batch, codes))
        del batch
        pa.default_memory_pool().release_unused()  # the pool keeps parsed pages otherwise

    for (segment, num_bytes), others in zip(scan.segments, scan.others, strict=True):
        try:
            lines = pa.PythonFile(_RequestLines(segment, num_bytes, others), mode="r")
            for batch in pa_json.open_json(lines, read_options=block, parse_options=options):
                pending.append(batch)
                if sum(part.num_rows for part in pending) >= MERGE_ROWS:
                    add_pending()
                del batch
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SlowPathNeeded(f"{segment.name}: {exc}") from exc
    if pending:
        add_pending()
    if plans.filled != scan.num_plans or observations.filled != scan.num_observations:
        raise SlowPathNeeded("the request lines parsed are not those counted")
    release_free_memory()  # the parse buffers' pages, before the join needs room
    return _join(plans, observations, codes)


_Kind = Literal["id", "codes", "ints", "floats", "bools"]
_PLAN_KINDS: dict[str, _Kind] = {
    "request_id": "id",
    **dict.fromkeys(_PLAN_COLUMNS, "codes"),
    "num_prompt_tokens": "ints",
    "max_tokens": "ints",
    "num_canaries": "ints",
}
_OBSERVATION_KINDS: dict[str, _Kind] = {
    "request_id": "id",
    "observed_tenant": "codes",
    "status": "ints",
    "ok": "bools",
    "outcome": "codes",
    "error_kind": "codes",
    "error": "codes",
    "finish_reason": "codes",
    "ttft_ms": "floats",
    "queue_ms": "floats",
    "total_ms": "floats",
    "prompt_tokens": "ints",
    "completion_tokens": "ints",
    "cached_tokens": "ints",
    "num_text_chars": "ints",
    "num_chunks": "ints",
    "text_redacted": "bools",
    "t_wall": "floats",
}
_DTYPES: dict[_Kind, type[np.generic]] = {
    "codes": np.int8,
    "ints": np.int64,
    "floats": np.float64,
    "bools": np.bool_,
}
MERGE_ROWS = 1 << 15
"""Parsed rows merged into one record batch before its columns are cut."""
ID_MERGE_BLOCKS = 64
"""Blocks of request ids merged into one array (compact buffers instead of many small)."""


class _Filled:
    """Columns of a known length, filled block by block; request ids as Arrow arrays."""

    def __init__(self, kinds: dict[str, _Kind], length: int) -> None:
        self.kinds = kinds
        self.length = length
        self.filled = 0
        self.ids: list[pa.Array] = []
        self.hashes = np.empty(length, np.uint64)
        """Each request id's 64-bit hash: the join matches these, then checks the ids."""
        self.num_unmerged = 0
        self.arrays: dict[str, npt.NDArray[Any]] = {}
        self.masks: dict[str, npt.NDArray[np.bool_]] = {}
        for name, kind in kinds.items():
            if kind != "id":
                self.arrays[name] = np.empty(length, _DTYPES[kind])
            if kind == "ints":
                self.masks[name] = np.empty(length, np.bool_)

    def add(self, block: dict[str, Any]) -> None:
        ids = block.pop("request_id")
        if ids.null_count:
            raise SlowPathNeeded("a request line without a request id")
        start, end = self.filled, self.filled + len(ids)
        if end > self.length:
            raise SlowPathNeeded("more request lines parsed than counted")
        for name, part in block.items():
            if isinstance(part, tuple):
                self.arrays[name][start:end], self.masks[name][start:end] = part
                continue
            if self.kinds[name] == "codes" and len(part):
                self._widen(name, int(part.max()))
            self.arrays[name][start:end] = part
        self.hashes[start:end] = _id_hashes(ids)
        self.filled = end
        self.ids.append(ids)
        self.num_unmerged += 1
        if self.num_unmerged == ID_MERGE_BLOCKS:
            merged = pa.concat_arrays(self.ids[-ID_MERGE_BLOCKS:])
            del self.ids[-ID_MERGE_BLOCKS:]
            self.ids.append(merged)
            self.num_unmerged = 0

    def _widen(self, name: str, code: int) -> None:
        """Codes start as int8 (most string columns have a few values) and widen once a
        column has more categories than its type holds."""
        array = self.arrays[name]
        if code > np.iinfo(array.dtype).max:
            wider = np.int16 if code <= np.iinfo(np.int16).max else np.int32
            self.arrays[name] = array.astype(wider)

    def take_ids(self) -> pa.ChunkedArray:
        ids = pa.chunked_array(self.ids, _S)
        self.ids = []
        return ids


def _id_hashes(ids: pa.Array) -> npt.NDArray[np.uint64]:
    """`hash_slices` of each id's UTF-8 bytes, read from the Arrow buffers as they are."""
    _, offsets_buffer, data_buffer = ids.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, len(ids) + 1, 4 * ids.offset)
    starts = offsets[:-1].astype(np.int64)
    data = (
        np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.empty(0, np.uint8)
    )
    return hash_slices(data, starts, np.diff(offsets).astype(np.int64))


class _RequestLines(io.RawIOBase):
    """A segment's plan and observation lines only, as a stream of bytes: the other records
    are decoded as events (`rare_events`) and may reuse a field name with another type (a
    run start's `canaries` is a table, a plan's a list), which Arrow's one schema cannot
    read. The first `num_bytes` of the file are read in large spans, the byte ranges
    `others` (as `rare_events` found them) skipped."""

    def __init__(self, path: Path, num_bytes: int, others: tuple[tuple[int, int], ...]) -> None:
        self._file = path.open("rb")
        self._spans: list[tuple[int, int]] = []
        position = 0
        for start, end in (*others, (num_bytes, num_bytes)):
            if start > position:
                self._spans.append((position, start))
            position = max(position, end)
        self._spans.reverse()  # popped from the end
        self._position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and self._spans:
            start, end = self._spans[-1]
            if self._position != start:
                self._file.seek(start)
            num = self._file.readinto(view[filled : filled + min(end - start, len(view) - filled)])
            if not num:  # the file is shorter than the first pass read: the counts tell
                self._spans.clear()
                break
            filled += num
            self._position = start + num
            if start + num == end:
                self._spans.pop()
            else:
                self._spans[-1] = (start + num, end)
        return filled

    def close(self) -> None:
        self._file.close()
        super().close()


class _Codes:
    """Category lists shared by every block, one per string column (`tenant` and
    `observed_tenant` share one): a block's dictionary becomes global codes, -1 for null."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, int]] = {}

    def encode(self, name: str, column: pa.Array) -> npt.NDArray[np.int32]:
        encoded = pc.dictionary_encode(column)
        known = self.values.setdefault(name, {})
        lookup = [known.setdefault(value, len(known)) for value in encoded.dictionary.to_pylist()]
        indices = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
        # -1 (null) picks the last entry, which is -1 itself
        global_codes: npt.NDArray[np.int32] = np.array([*lookup, -1], np.int32)[indices]
        return global_codes

    def categories(self, name: str) -> list[str]:
        return list(self.values.get(name, {}))


def _ints(column: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Values (0 where null) and the null mask."""
    values = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return values, pc.is_null(column).to_numpy(zero_copy_only=False)


def _floats(column: pa.Array) -> npt.NDArray[np.float64]:
    array: npt.NDArray[np.float64] = column.to_numpy(zero_copy_only=False).astype(
        np.float64, copy=False
    )
    return array


def _bools(column: pa.Array) -> npt.NDArray[np.bool_]:
    array: npt.NDArray[np.bool_] = pc.fill_null(column, False).to_numpy(zero_copy_only=False)
    return array


def _plans(batch: pa.RecordBatch, codes: _Codes) -> dict[str, Any]:
    rows = batch.filter(pc.equal(batch.column("type"), "plan"))
    columns: dict[str, Any] = {"request_id": rows.column("request_id")}
    for name in _PLAN_COLUMNS:
        columns[name] = codes.encode(name, rows.column(name))
    columns["num_prompt_tokens"] = _ints(rows.column("num_prompt_tokens"))
    columns["max_tokens"] = _ints(rows.column("max_tokens"))
    columns["num_canaries"] = _ints(pc.list_value_length(rows.column("canaries")))
    return columns


def _observations(batch: pa.RecordBatch, codes: _Codes) -> dict[str, Any]:
    rows = batch.filter(pc.equal(batch.column("type"), "observation"))
    status, error_kind = rows.column("status"), rows.column("error_kind")
    sent = rows.column("t_sent_ns")
    ok = pc.and_kleene(
        pc.and_kleene(pc.greater_equal(status, 200), pc.less(status, 300)),
        pc.is_null(error_kind),
    )
    ok = pc.fill_null(ok, False)
    usage = rows.column("usage")
    error = pc.utf8_slice_codeunits(rows.column("error"), 0, MAX_ERROR_CHARS)
    return {
        "request_id": rows.column("request_id"),
        "observed_tenant": codes.encode("tenant", rows.column("tenant")),
        "status": _ints(status),
        "ok": _bools(ok),
        "outcome": codes.encode("outcome", _outcome(ok, status, error_kind)),
        "error_kind": codes.encode("error_kind", error_kind),
        "error": codes.encode("error", error),
        "finish_reason": codes.encode("finish_reason", rows.column("finish_reason")),
        "ttft_ms": _floats(_ms(pc.subtract(rows.column("t_first_token_ns"), sent))),
        "queue_ms": _floats(_ms(pc.subtract(sent, rows.column("t_scheduled_ns")))),
        "total_ms": _floats(_ms(pc.subtract(rows.column("t_done_ns"), sent))),
        "prompt_tokens": _ints(pc.struct_field(usage, "prompt_tokens")),
        "completion_tokens": _ints(pc.struct_field(usage, "completion_tokens")),
        "cached_tokens": _ints(pc.struct_field(usage, "cached_tokens")),
        "num_text_chars": _ints(rows.column("num_text_chars")),
        "num_chunks": _ints(rows.column("num_chunks")),
        "text_redacted": _bools(rows.column("text_redacted")),
        "t_wall": _floats(rows.column("t_wall")),
    }


def _ms(ns: pa.Array) -> pa.Array:
    return pc.divide(pc.cast(ns, _F), 1e6)


def _outcome(ok: pa.Array, status: pa.Array, error_kind: pa.Array) -> pa.Array:
    """As `reports.frames.outcome_of`, for a column of observations."""
    two_xx = pc.and_kleene(pc.greater_equal(status, 200), pc.less(status, 300))
    http_error = pc.or_(
        pc.fill_null(pc.equal(error_kind, "http_status"), False),
        pc.fill_null(pc.and_kleene(pc.is_valid(status), pc.invert(two_xx)), False),
    )
    deliberate = pc.fill_null(pc.is_in(error_kind, pa.array(DELIBERATE_ERRORS)), False)
    return pc.case_when(
        pc.make_struct(ok, http_error, deliberate),
        "accepted",
        "rejected",
        "disconnected",
        "errored",
    )


_TO_PANDAS = {_I: pd.Int64Dtype()}
_STR_DTYPE = pd.StringDtype("pyarrow", na_value=np.nan)
"""pandas' default `str` dtype, as Arrow strings convert to."""


def _pandas(array: pa.Array) -> pd.Series[Any]:
    series: pd.Series[Any] = array.to_pandas(types_mapper=_TO_PANDAS.get)
    return series


def _categorical(
    codes: npt.NDArray[np.signedinteger[Any]], categories: list[str]
) -> pd.Series[Any]:
    """Codes as a pandas categorical of the categories present, in order of first
    appearance (as Arrow's `dictionary_encode` of the whole column gives them)."""
    present, first = np.unique(codes[codes >= 0], return_index=True)
    ranked = present[np.argsort(first, kind="stable")]
    remap = np.full(len(categories) + 1, -1, np.int32)
    remap[ranked] = np.arange(len(ranked), dtype=np.int32)
    local = remap[codes]  # -1 (null) picks the last entry, -1
    indices = pa.array(local, mask=local < 0, type=pa.int32())
    dictionary = pa.array([categories[i] for i in ranked], _S)
    return _pandas(pa.DictionaryArray.from_arrays(indices, dictionary))


def _join(plans: _Filled, observations: _Filled, codes: _Codes) -> pd.DataFrame:
    """Observations with their plans (a lost plan leaves nulls and the observed tenant),
    then the plans nothing answered; one column at a time, each input freed once used."""
    # Matched by hash, sorted (a hash table of a million ids would cost far more), then
    # every match checked against the ids themselves.
    order = np.argsort(plans.hashes, kind="stable")
    hashes = plans.hashes[order]
    del plans.hashes
    if np.any(hashes[1:] == hashes[:-1]):
        raise SlowPathNeeded("a request id planned twice (or two ids with one hash)")
    position = np.minimum(np.searchsorted(hashes, observations.hashes), max(len(hashes) - 1, 0))
    found = hashes[position] == observations.hashes if len(hashes) else position < 0
    del hashes, observations.hashes
    plan_of = np.where(found, order[position] if len(order) else -1, -1)  # -1: a lost plan
    del order, position, found
    plan_ids = plans.take_ids().combine_chunks()
    observed_ids = observations.take_ids()
    _check_matches(plan_ids, observed_ids, plan_of)
    matched = plan_of[plan_of >= 0]
    answered = np.zeros(len(plan_ids), bool)
    answered[matched] = True
    if int(answered.sum()) != len(matched):
        raise SlowPathNeeded("a request observed twice")
    del matched
    unanswered = np.flatnonzero(~answered)
    del answered
    num_observed, num_unanswered = len(plan_of), len(unanswered)
    rows = np.concatenate([plan_of, unanswered])  # -1 (a lost plan) reads a null sentinel
    del plan_of
    columns: dict[str, pd.Series[Any]] = {}
    unanswered_ids = plan_ids.take(pa.array(unanswered, pa.int64()))
    ids = pa.chunked_array([*observed_ids.chunks, unanswered_ids], _S)
    del observed_ids, plan_ids, unanswered, unanswered_ids
    # wrapped as they are (pandas' Arrow-backed `str`); a conversion would copy them
    columns["request_id"] = ids.to_pandas(types_mapper={_S: _STR_DTYPE}.get)
    del ids
    observed_tenant = observations.arrays.pop("observed_tenant")
    for name in [name for name in plans.kinds if name != "request_id"]:
        values = plans.arrays.pop(name)
        if plans.kinds[name] == "codes":
            gathered = np.append(values, values.dtype.type(-1))[rows]
            del values
            if name == "tenant":
                lost = gathered[:num_observed] < 0
                gathered[:num_observed][lost] = observed_tenant[lost]
                del lost
            columns[name] = _categorical(gathered, codes.categories(name))
        else:
            mask = np.append(plans.masks.pop(name), True)[rows]
            gathered = np.append(values, np.int64(0))[rows]
            del values
            columns[name] = _integers(gathered, mask)
        del gathered
    del observed_tenant, rows
    columns["answered"] = pd.Series(np.arange(num_observed + num_unanswered) < num_observed)
    for name in [name for name in observations.kinds if name in observations.arrays]:
        columns[name] = _observed(name, observations, num_unanswered, codes)
    return pd.DataFrame(columns, copy=False)


CHECK_ROWS = 1 << 16
"""Matched ids compared this many at a time (a gathered copy of every plan id would cost
as much as the ids themselves)."""


def _check_matches(plan_ids: pa.Array, observed_ids: pa.ChunkedArray, plan_of: Any) -> None:
    """Every observation matched to a plan by hash has that plan's request id."""
    for start in range(0, len(plan_of), CHECK_ROWS):
        rows = plan_of[start : start + CHECK_ROWS]
        planned = plan_ids.take(pa.array(rows, mask=rows < 0))
        same = pc.equal(observed_ids.slice(start, len(rows)), planned)
        if pc.all(same).as_py() not in (True, None):
            raise SlowPathNeeded("two request ids with one hash")


def _observed(
    name: str, observations: _Filled, num_unanswered: int, codes: _Codes
) -> pd.Series[Any]:
    """One observation column, the unanswered plans' rows appended (null, or the default
    `ok` False and `outcome` "unanswered")."""
    kind = observations.kinds[name]
    values = observations.arrays.pop(name)
    if kind == "ints":
        mask = observations.masks.pop(name)
        if num_unanswered:
            values = np.concatenate([values, np.zeros(num_unanswered, np.int64)])
            mask = np.concatenate([mask, np.ones(num_unanswered, bool)])
        return _integers(values, mask)
    if kind == "codes":
        filler = -1
        if name == "outcome":
            known = codes.values.setdefault("outcome", {})
            filler = known.setdefault("unanswered", len(known))
        if num_unanswered:
            values = np.concatenate([values, np.full(num_unanswered, filler, np.int32)])
        return _categorical(values, codes.categories(name))
    if kind == "bools":
        if not num_unanswered:
            return pd.Series(values)
        if name == "ok":
            return pd.Series(np.concatenate([values, np.zeros(num_unanswered, bool)]))
        # text_redacted: unknown without an answer
        return pd.Series(np.concatenate([values.astype(object), np.full(num_unanswered, None)]))
    if num_unanswered:
        values = np.concatenate([values, np.full(num_unanswered, np.nan)])
    return pd.Series(values)


def _integers(values: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> pd.Series[Any]:
    return pd.Series(pd.arrays.IntegerArray(values, mask), copy=False)
