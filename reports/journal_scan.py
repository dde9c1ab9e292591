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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json

from kvcanary.harness.record.columns import line_schema
from kvcanary.harness.record.decoding import UnknownFields
from kvcanary.harness.record.events import (
    OBSERVATION_RECORD,
    PLAN_RECORD,
    SCHEMA_VERSION,
    Event,
    RunFinished,
    RunStarted,
    from_record,
)
from kvcanary.harness.record.journal import journal_segments
from kvcanary.harness.record.segments import open_segment
from kvcanary.reports.accounting import Accounting
from kvcanary.reports.allocator import release_free_memory
from kvcanary.reports.journal_lines import (
    OBSERVATION,
    OTHER,
    PLAN,
    Chunk,
    SlowPathNeeded,
    chunks,
)
from kvcanary.reports.line_accounting import LineTally
from kvcanary.reports.request_columns import (
    OBSERVATION_KINDS,
    PLAN_CODES,
    PLAN_KINDS,
    Codes,
    Filled,
    join,
    observation_columns,
    plan_columns,
)

BLOCK_BYTES = 1 << 20
"""Arrow's parse block: small blocks keep the reader's buffers small."""
_LINE_SCHEMA = line_schema(
    {
        PLAN_RECORD: (
            "request_id",
            *PLAN_CODES,
            "num_prompt_tokens",
            "max_tokens",
            "num_canaries",  # journaled with the packed canaries (`plan_line`)
            "canaries.index",  # older journals list them: counted only, their text unread
        ),
        OBSERVATION_RECORD: (
            "request_id",
            "tenant",
            "status",
            "t_wall",
            "t_scheduled_ns",
            "t_sent_ns",
            "t_first_token_ns",
            "t_done_ns",
            "text_redacted",
            "num_text_chars",
            "num_chunks",
            "usage",
            "finish_reason",
            "error_kind",
            "error",
        ),
    }
)
"""The fields of plan and observation lines the request table uses, typed as their
dataclasses declare them (`harness.record.columns`)."""


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
    unknown: UnknownFields
    """Fields this version does not know, seen in the events and in the first request lines
    of each chunk; warned by the caller once the fast path has read the whole journal."""
    accounting: Accounting | None = None
    """Every plan observed once, found in the same pass (`reports.line_accounting`); None
    when the ids must be named (`reports.accounting` then reads the lines again)."""


def rare_events(run_dir: Path) -> JournalScan:
    """One pass over the raw lines: the rare events decoded, the request lines counted."""
    events: list[Event] = []
    segments: list[tuple[Path, int]] = []
    others: list[tuple[tuple[int, int], ...]] = []
    longest = num_plans = num_observations = 0
    unknown = UnknownFields()
    tally = LineTally()
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
            _sample_unknown_fields(chunk, kinds, unknown, segment.name)
            tally.chunk(chunk, kinds, requests)
            for index in np.flatnonzero(~requests).tolist():
                line = chunk.line(index)
                start = chunk.offset + int(chunk.starts[index])
                ranges.append((start, start + len(line)))
                if not line.endswith(b"}\n"):
                    if line.strip():
                        raise SlowPathNeeded(f"{segment.name}: a torn or corrupt line")
                    continue
                events.append(decode_line(line, unknown, segment.name))
                _tell(tally, events[-1], index)
            tally.end_chunk()
        segments.append((segment, size))
        others.append(tuple(ranges))
    return JournalScan(
        events,
        longest,
        tuple(segments),
        num_plans,
        num_observations,
        tuple(others),
        unknown,
        tally.result(),
    )


def _tell(tally: LineTally, event: Event, index: int) -> None:
    if isinstance(event, RunStarted):
        tally.started(index)
    elif isinstance(event, RunFinished):
        tally.finished(index)


def decode_line(line: bytes, unknown: UnknownFields | None = None, where: str = "") -> Event:
    """The event of a whole line, exactly as `read_journal` reads it, or `SlowPathNeeded`.
    Fields this version does not know are dropped with one warning each (`unknown`)."""
    names: set[str] = set()
    try:
        event = from_record(json.loads(line), names)
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise SlowPathNeeded(f"a record that does not decode: {exc}") from exc
    if isinstance(event, RunStarted) and event.schema > SCHEMA_VERSION:
        raise SlowPathNeeded("a journal from a newer schema")
    if unknown is not None:
        unknown.note(names, where)
    return event


def _sample_unknown_fields(chunk: Chunk, kinds: Any, unknown: UnknownFields, where: str) -> None:
    """Warn of fields this version does not know in the chunk's first plan and observation
    (Arrow reads the fields it knows exactly and ignores the others, so a newer kvcanary's
    extra fields cost nothing but this warning)."""
    for kind in (PLAN, OBSERVATION):
        first = np.flatnonzero(kinds == kind)[:1].tolist()
        if first and chunk.line(first[0]).endswith(b"}\n"):
            decode_line(chunk.line(first[0]), unknown, where)


def request_frame(run_dir: Path, scan: JournalScan | None = None) -> pd.DataFrame:
    """One row per planned or observed request, columns as `reports.frames.REQUEST_SCHEMA`
    (without the limit ratios): observations in journal order, then unanswered plans.

    The columns are numpy arrays sized from the line counts of `scan` and filled block by
    block as Arrow parses (string columns as codes into one category list per column), so
    Arrow holds one block at a time besides the request ids, and no joined table exists:
    the observations keep their order, only the plan columns are gathered by each
    observation's plan, and each array becomes a pandas column as it is."""
    scan = scan if scan is not None else rare_events(run_dir)
    codes = Codes()
    plans = Filled(PLAN_KINDS, scan.num_plans)
    observations = Filled(OBSERVATION_KINDS, scan.num_observations)
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
        try:
            plans.add(plan_columns(batch, codes))
            observations.add(observation_columns(batch, codes))
        except UnicodeDecodeError as exc:  # Arrow's parser lets invalid UTF-8 through
            raise SlowPathNeeded(f"a string that is not UTF-8: {exc}") from exc
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
        except pa.ArrowException as exc:  # a line Arrow cannot read as the schema says
            raise SlowPathNeeded(f"{segment.name}: {exc}") from exc
    if pending:
        add_pending()
    if plans.filled != scan.num_plans or observations.filled != scan.num_observations:
        raise SlowPathNeeded("the request lines parsed are not those counted")
    release_free_memory()  # the parse buffers' pages, before the join needs room
    return join(plans, observations, codes)


MERGE_ROWS = 1 << 15
"""Parsed rows merged into one record batch before its columns are cut."""


class _RequestLines(io.RawIOBase):
    """A segment's plan and observation lines only, as a stream of bytes: the other records
    are decoded as events (`rare_events`) and may reuse a field name with another type (a
    run start's `canaries` is a table, a plan's a list), which Arrow's one schema cannot
    read. The first `num_bytes` of the file are read in large spans, the byte ranges
    `others` (as `rare_events` found them) skipped."""

    def __init__(self, path: Path, num_bytes: int, others: tuple[tuple[int, int], ...]) -> None:
        self._file = open_segment(path)  # compressed or not: read forward only
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
