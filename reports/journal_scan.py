"""The fast way through a large journal: plans and observations parsed by Arrow, in C++.

A run of a million requests journals two million plan and observation lines. Turning each
into an event object (`harness.record.journal.read_journal`) costs tens of seconds; the
report needs only a few plain fields of each. So:

- one cheap pass over the lines (no JSON parsing) sets aside the few lines that are not
  plans or observations (run start and end, phases, findings, probe verdicts, timing fits),
  which are then decoded as events in the ordinary way;
- `pyarrow.json` parses the file in blocks against an explicit schema of just the fields
  the request table uses (response text, hashes and canary text are skipped unread), and
  each block is cut down to compact columns right away;
- plans are joined to their observations by request id, vectorised.

Anything this path is not sure to read exactly as `read_journal` would (a corrupt or torn
line, a record that does not decode, a journal from a newer schema, a request id planned or
observed twice) raises `SlowPathNeeded`, and `reports.frames` falls back to the event-by-event
reader, which skips damage with a warning. `request_lines` is the same idea for the evidence
pass: only lines whose request id a finding names are decoded.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from harness.record.events import (
    SCHEMA_VERSION,
    Event,
    ObservationRecorded,
    PlanRecorded,
    RunStarted,
    from_record,
)
from harness.record.journal import journal_segments

PLAN_PREFIX = b'{"type":"plan","request_id":"'
OBSERVATION_PREFIX = b'{"type":"observation","request_id":"'
_REQUEST_PREFIXES = (PLAN_PREFIX, OBSERVATION_PREFIX)
_RECORD_START = b'{"type":"'
"""How `harness.record.journal.encode_event` starts every line (compact, `type` first)."""
BLOCK_BYTES = 1 << 20
"""Arrow's parse block: small blocks keep the reader's buffers small."""
MERGE_BLOCKS = 64
"""Blocks merged into one batch as they are read (about 64k requests)."""
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


def rare_events(run_dir: Path) -> tuple[list[Event], int]:
    """Every event that is not a plan or an observation, in journal order, and the length
    of the longest line (a block must hold a whole line)."""
    events: list[Event] = []
    longest = 0
    for segment in journal_segments(run_dir):
        with segment.open("rb") as handle:
            for line in handle:
                longest = max(longest, len(line))
                if not line.endswith(b"}\n"):
                    if line.strip():
                        raise SlowPathNeeded(f"{segment.name}: a torn or corrupt line")
                    continue
                if line.startswith(_REQUEST_PREFIXES):
                    continue
                events.append(_decode(line))
    return events, longest


def request_lines(run_dir: Path, request_ids: set[str]) -> Iterator[Event]:
    """The plan and observation events of the given requests (one pass, few decodes)."""
    wanted = {request_id.encode() for request_id in request_ids}
    for segment in journal_segments(run_dir):
        with segment.open("rb") as handle:
            for line in handle:
                prefix = next((p for p in _REQUEST_PREFIXES if line.startswith(p)), None)
                if prefix is not None:
                    end = line.find(b'"', len(prefix))
                    if line[len(prefix) : end] in wanted:
                        yield _decode(line)
                elif not line.startswith(_RECORD_START) and line.strip():
                    # not written the way `encode_event` writes: decode it to be sure
                    event = _decode(line)
                    if _request_id(event) in request_ids:
                        yield event


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


def request_table(run_dir: Path, longest_line: int = 0) -> pa.Table:
    """One row per planned or observed request, columns as `reports.frames.REQUEST_SCHEMA`
    (without the limit ratios): observations in journal order, then unanswered plans."""
    plans: list[pa.RecordBatch] = []
    observations: list[pa.RecordBatch] = []
    options = pa_json.ParseOptions(explicit_schema=_LINE_SCHEMA, unexpected_field_behavior="ignore")
    # One thread and small blocks: parsing is not the slow part, and every block in
    # flight costs its buffers.
    block = pa_json.ReadOptions(block_size=max(BLOCK_BYTES, 2 * longest_line), use_threads=False)
    num_small = 0  # blocks since the last merge
    for segment in journal_segments(run_dir):
        try:
            lines = pa.PythonFile(_RequestLines(segment), mode="r")
            for batch in pa_json.open_json(lines, read_options=block, parse_options=options):
                plans.append(_plans(batch))
                observations.append(_observations(batch))
                num_small += 1
                if num_small == MERGE_BLOCKS:
                    _merge_tail(plans, num_small)
                    _merge_tail(observations, num_small)
                    num_small = 0
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SlowPathNeeded(f"{segment.name}: {exc}") from exc
    if not plans:
        raise SlowPathNeeded("no plan or observation blocks")
    plan = _columns(plans)
    observed = _columns(observations)
    del plans, observations
    return _join(plan, observed)


class _RequestLines(io.RawIOBase):
    """A segment's plan and observation lines only, as a stream of bytes: the other records
    are decoded as events (`rare_events`) and may reuse a field name with another type (a
    run start's `canaries` is a table, a plan's a list), which Arrow's one schema cannot
    read."""

    def __init__(self, path: Path) -> None:
        self._lines = path.open("rb")
        self._pending = bytearray()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while len(self._pending) < len(view):
            line = self._lines.readline()
            if not line:
                break
            if line.startswith(_REQUEST_PREFIXES):
                self._pending += line
        num = min(len(view), len(self._pending))
        view[:num] = self._pending[:num]
        del self._pending[:num]
        return num

    def close(self) -> None:
        self._lines.close()
        super().close()


def _merge_tail(batches: list[pa.RecordBatch], num: int) -> None:
    """The last `num` small batches as one: a few large buffers instead of many small ones,
    which the allocator can reuse once they are freed (many small ones it cannot)."""
    tail = pa.Table.from_batches(batches[-num:]).combine_chunks()
    del batches[-num:]
    batches.extend(tail.to_batches())


def _columns(batches: list[pa.RecordBatch]) -> dict[str, pa.ChunkedArray]:
    """Batches as one chunked column per name (each block keeps its own dictionaries)."""
    names = batches[0].schema.names
    return {name: pa.chunked_array([batch.column(name) for batch in batches]) for name in names}


def _plans(batch: pa.RecordBatch) -> pa.RecordBatch:
    rows = batch.filter(pc.equal(batch.column("type"), "plan"))
    columns: dict[str, pa.Array] = {"request_id": rows.column("request_id")}
    for name in _PLAN_COLUMNS:
        columns[name] = pc.dictionary_encode(rows.column(name))
    columns["num_prompt_tokens"] = rows.column("num_prompt_tokens")
    columns["max_tokens"] = rows.column("max_tokens")
    columns["num_canaries"] = pc.cast(pc.list_value_length(rows.column("canaries")), _I)
    return pa.RecordBatch.from_pydict(columns)


def _observations(batch: pa.RecordBatch) -> pa.RecordBatch:
    rows = batch.filter(pc.equal(batch.column("type"), "observation"))
    status, error_kind = rows.column("status"), rows.column("error_kind")
    sent = rows.column("t_sent_ns")
    ok = pc.and_kleene(
        pc.and_kleene(pc.greater_equal(status, 200), pc.less(status, 300)),
        pc.is_null(error_kind),
    )
    ok = pc.fill_null(ok, False)
    usage = rows.column("usage")
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "request_id": rows.column("request_id"),
        "observed_tenant": pc.dictionary_encode(rows.column("tenant")),
        "status": status,
        "ok": ok,
        "outcome": pc.dictionary_encode(_outcome(ok, status, error_kind)),
        "error_kind": pc.dictionary_encode(error_kind),
        "error": pc.dictionary_encode(pc.utf8_slice_codeunits(rows.column("error"), 0, 200)),
        "finish_reason": pc.dictionary_encode(rows.column("finish_reason")),
        "ttft_ms": _ms(pc.subtract(rows.column("t_first_token_ns"), sent)),
        "queue_ms": _ms(pc.subtract(sent, rows.column("t_scheduled_ns"))),
        "total_ms": _ms(pc.subtract(rows.column("t_done_ns"), sent)),
        "prompt_tokens": pc.struct_field(usage, "prompt_tokens"),
        "completion_tokens": pc.struct_field(usage, "completion_tokens"),
        "cached_tokens": pc.struct_field(usage, "cached_tokens"),
        "num_text_chars": rows.column("num_text_chars"),
        "num_chunks": rows.column("num_chunks"),
        "text_redacted": pc.fill_null(rows.column("text_redacted"), False),
        "t_wall": rows.column("t_wall"),
    }
    return pa.RecordBatch.from_pydict(columns)


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


def _join(plan: dict[str, pa.ChunkedArray], observed: dict[str, pa.ChunkedArray]) -> pa.Table:
    """Observations with their plans (a lost plan leaves nulls and the observed tenant),
    then the plans nothing answered. Columns are consumed one at a time, so the inputs and
    the result are never all held at once."""
    plan_ids = plan.pop("request_id").combine_chunks()
    observed_ids = observed.pop("request_id").combine_chunks()
    # Each plan's first occurrence is itself unless its id was planned before (cheaper in
    # memory than counting distinct ids, which holds a second copy of every id).
    first = pc.index_in(plan_ids, value_set=plan_ids).to_numpy(zero_copy_only=False)
    if not np.array_equal(first, np.arange(len(plan_ids))):
        raise SlowPathNeeded("a request id planned twice")
    del first
    index = pc.index_in(observed_ids, value_set=plan_ids)
    matched_plans = index.drop_null().to_numpy()
    answered = np.zeros(len(plan_ids), bool)
    answered[matched_plans] = True
    if int(answered.sum()) != len(matched_plans):
        raise SlowPathNeeded("a request observed twice")
    unanswered = pa.array(np.flatnonzero(~answered))
    del answered, matched_plans
    num_observed, num_unanswered = len(observed_ids), len(unanswered)
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "request_id": pa.concat_arrays([observed_ids, plan_ids.take(unanswered)])
    }
    del plan_ids, observed_ids
    observed_tenant = pc.cast(observed.pop("observed_tenant"), _S)
    for name in list(plan):
        column = plan.pop(name)
        if name in _PLAN_COLUMNS:
            column = pc.cast(column, _S)
        matched = column.take(index)
        if name == "tenant":
            matched = pc.coalesce(matched, observed_tenant)
        joined = pa.concat_arrays(
            [matched.combine_chunks(), column.take(unanswered).combine_chunks()]
        )
        columns[name] = _cat(joined) if name in _PLAN_COLUMNS else joined
    del observed_tenant
    columns["answered"] = pa.concat_arrays(
        [pa.array(np.ones(num_observed, bool)), pa.array(np.zeros(num_unanswered, bool))]
    )
    defaults: dict[str, Any] = {"ok": False, "outcome": "unanswered"}
    for name in list(observed):
        column = observed.pop(name)
        if pa.types.is_dictionary(column.type):
            column = pc.cast(column, _S)
        filler = pa.nulls(num_unanswered, column.type)
        if name in defaults:
            filler = pa.array([defaults[name]] * num_unanswered, column.type)
        joined = pa.chunked_array([*column.chunks, filler], column.type)
        del column
        columns[name] = _cat(joined) if pa.types.is_string(joined.type) else joined
    return pa.table(columns)


def _cat(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    whole = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    encoded: pa.Array = pc.cast(pc.dictionary_encode(whole), pa.dictionary(pa.int32(), _S))
    return encoded
