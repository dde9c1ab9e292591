"""A run's journal as pandas tables: requests, findings, and aggregates per tenant and size.

`load_frames` is a pure function of the journal. It reads plans and observations through
`reports.journal_scan` (Arrow's JSON reader, no event objects) where that path can read the
journal exactly, and otherwise through `frames_from_events`, which streams events once and
builds columns incrementally in Arrow record batches, so a journal of millions of
observations never holds more event objects than there are requests in flight (a plan waits
in `pending` only until its observation arrives). Both give the same frames. Response
text, hashes and other per-request blobs are left out: text may be another customer's data,
and the few requests a finding names are re-read from the journal by `reports.evidence`, so
a row costs under 200 bytes.

It does not judge anything: verdicts live in `reports.summary`, detection in the harness.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    ProbeFinished,
    RunFinished,
    RunStarted,
    TargetServing,
    TargetUnhealthy,
    TimingFitted,
)
from kvcanary.harness.record.journal import read_journal, warn_journal
from kvcanary.harness.record.observation import Observation
from kvcanary.reports.accounting import Accounting
from kvcanary.reports.allocator import release_free_memory, return_large_buffers
from kvcanary.reports.journal_lines import SlowPathNeeded
from kvcanary.reports.journal_scan import rare_events, request_frame
from kvcanary.reports.request_columns import DELIBERATE_ERRORS, MAX_ERROR_CHARS
from kvcanary.tenants.plan import RequestPlan

CHUNK_ROWS = 16_384
OUTCOMES = ("accepted", "rejected", "disconnected", "errored", "unanswered")

_STR = pa.string()
_CAT = pa.dictionary(pa.int32(), pa.string())
_INT = pa.int64()
_FLOAT = pa.float64()
_BOOL = pa.bool_()
_TYPES = {_INT: pd.Int64Dtype()}

_PLAN_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("request_id", _STR),
    ("tenant", _CAT),
    ("phase", _CAT),
    ("intent", _CAT),
    ("size_label", _CAT),
    ("expected", _CAT),
    ("api", _CAT),
    ("num_prompt_tokens", _INT),
    ("max_tokens", _INT),
    ("num_canaries", _INT),
)
_OBSERVATION_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("answered", _BOOL),
    ("status", _INT),
    ("ok", _BOOL),
    ("outcome", _CAT),
    ("error_kind", _CAT),
    ("error", _CAT),
    ("finish_reason", _CAT),
    ("ttft_ms", _FLOAT),
    ("queue_ms", _FLOAT),
    ("total_ms", _FLOAT),
    ("prompt_tokens", _INT),
    ("completion_tokens", _INT),
    ("cached_tokens", _INT),
    ("num_text_chars", _INT),
    ("num_chunks", _INT),
    ("text_redacted", _BOOL),
    ("t_wall", _FLOAT),
)
REQUEST_SCHEMA = pa.schema(_PLAN_FIELDS + _OBSERVATION_FIELDS)
"""One row per planned request, joined with its observation (nulls where none arrived)."""

FINDING_SCHEMA = pa.schema(
    [
        ("kind", _CAT),
        ("severity", _CAT),
        ("detector", _CAT),
        ("request_id", _STR),
        ("tenant", _CAT),
        ("victim_tenant", _CAT),
        ("victim_request_id", _STR),
        ("marker", _STR),
        ("offset_start", _INT),
        ("offset_end", _INT),
        ("excerpt", _STR),
        ("summary", _STR),
        ("details_json", _STR),
        ("t_wall", _FLOAT),
    ]
)
"""One row per finding; `details` travels as JSON text (it is free-form per detector)."""

_NO_PLAN: tuple[Any, ...] = (None,) * (len(_PLAN_FIELDS) - 1)
_NO_OBSERVATION: tuple[Any, ...] = (False, None, False, "unanswered") + (None,) * (
    len(_OBSERVATION_FIELDS) - 4
)


@dataclass(frozen=True)
class RunFrames:
    """Everything a report shows, as tables plus the run's start and end records."""

    run: RunStarted | None
    """None only for a journal whose first record was lost."""
    finished: RunFinished | None
    """None when the run never wrote its end (crash, kill -9)."""
    phases: tuple[PhaseStarted, ...]
    requests: pd.DataFrame
    findings: pd.DataFrame
    probes: tuple[ProbeFinished, ...] = ()
    """Verdicts of the opt-in probe phases that ran (the cache probe)."""
    timing: TimingFitted | None = None
    """The timing detector's last journaled TTFT model (None: no fit was journaled)."""
    health: tuple[TargetUnhealthy | TargetServing, ...] = ()
    """When the target stopped serving mid-run, and when it answered again."""


class _Columns:
    """Rows appended one at a time, kept as Arrow record batches of `CHUNK_ROWS` rows."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.rows: list[tuple[Any, ...]] = []
        self.batches: list[pa.RecordBatch] = []

    def append(self, row: tuple[Any, ...]) -> None:
        assert len(row) == len(self.schema), "row does not match the frame's schema"
        self.rows.append(row)
        if len(self.rows) >= CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        arrays = []
        for column, field in zip(zip(*self.rows, strict=True), self.schema, strict=True):
            if pa.types.is_dictionary(field.type):
                arrays.append(pa.array(column, _STR).dictionary_encode())
            else:
                arrays.append(pa.array(column, field.type))
        self.batches.append(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.rows = []

    def to_pandas(self) -> pd.DataFrame:
        self._flush()
        table = pa.Table.from_batches(self.batches, schema=self.schema)
        self.batches = []
        # Arrow buffers are released column by column as pandas takes them over, so the
        # conversion never holds two full copies of a large run's tables.
        frame: pd.DataFrame = table.to_pandas(
            types_mapper=_TYPES.get, self_destruct=True, split_blocks=True
        )
        return frame


def _plan_row(plan: RequestPlan) -> tuple[Any, ...]:
    return (
        plan.tenant,
        plan.phase,
        plan.intent,
        plan.size_label,
        plan.expected,
        plan.api,
        plan.num_prompt_tokens,
        plan.max_tokens,
        len(plan.canaries),
    )


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e6


def outcome_of(observation: Observation) -> str:
    """`accepted` (a success), `rejected` (an HTTP error status), `disconnected` (ended by the
    harness on purpose: `DELIBERATE_ERRORS`) or `errored` (anything else)."""
    if observation.ok:
        return "accepted"
    if observation.error_kind == "http_status" or (
        observation.status is not None and not 200 <= observation.status < 300
    ):
        return "rejected"
    if observation.error_kind in DELIBERATE_ERRORS:
        return "disconnected"
    return "errored"


def _observation_row(observation: Observation) -> tuple[Any, ...]:
    usage = observation.usage
    total_ns = (
        None if observation.t_done_ns is None else observation.t_done_ns - observation.t_sent_ns
    )
    error = observation.error[:MAX_ERROR_CHARS] if observation.error is not None else None
    return (
        True,
        observation.status,
        observation.ok,
        outcome_of(observation),
        observation.error_kind,
        error,
        observation.finish_reason,
        _ms(observation.ttft_ns),
        _ms(observation.queue_ns),
        _ms(total_ns),
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        observation.num_text_chars,
        observation.num_chunks,
        observation.text_redacted,
        observation.t_wall,
    )


def _finding_row(event: FindingRecorded) -> tuple[Any, ...]:
    finding = event.finding
    start, end = finding.offsets if finding.offsets is not None else (None, None)
    return (
        str(finding.kind),
        str(finding.severity),
        finding.detector,
        finding.request_id,
        finding.tenant,
        finding.victim_tenant,
        finding.victim_request_id,
        finding.marker,
        start,
        end,
        finding.excerpt,
        finding.summary,
        json.dumps(finding.details, sort_keys=True, default=str),
        event.t_wall,
    )


def frames_from_events(events: Iterable[Event]) -> RunFrames:
    """Build the run's tables from its events, in one streaming pass."""
    run: RunStarted | None = None
    finished: RunFinished | None = None
    phases: list[PhaseStarted] = []
    probes: list[ProbeFinished] = []
    timing: TimingFitted | None = None
    health: list[TargetUnhealthy | TargetServing] = []
    pending: dict[str, tuple[Any, ...]] = {}
    requests = _Columns(REQUEST_SCHEMA)
    findings = _Columns(FINDING_SCHEMA)
    for event in events:
        if isinstance(event, ObservationRecorded):
            observation = event.observation
            plan_row = pending.pop(observation.request_id, None)
            if plan_row is None:  # an observation whose plan was lost keeps its tenant
                plan_row = (observation.tenant, *_NO_PLAN[1:])
            requests.append((observation.request_id, *plan_row, *_observation_row(observation)))
        elif isinstance(event, PlanRecorded):
            pending[event.plan.request_id] = _plan_row(event.plan)
        elif isinstance(event, FindingRecorded):
            findings.append(_finding_row(event))
        elif isinstance(event, PhaseStarted):
            phases.append(event)
        elif isinstance(event, RunStarted):
            run = event
        elif isinstance(event, RunFinished):
            finished = event
        elif isinstance(event, ProbeFinished):
            probes.append(event)
        elif isinstance(event, TimingFitted):
            timing = event
        elif isinstance(event, TargetUnhealthy | TargetServing):
            health.append(event)
    for request_id, plan_row in pending.items():
        requests.append((request_id, *plan_row, *_NO_OBSERVATION))
    table = requests.to_pandas()
    _add_limit_ratios(table, run)
    return RunFrames(
        run,
        finished,
        tuple(phases),
        table,
        findings.to_pandas(),
        tuple(probes),
        timing,
        tuple(health),
    )


def load_frames(run_dir: Path) -> RunFrames:
    """The tables of the run recorded in `run_dir`: through `reports.journal_scan` when it
    can read the journal exactly, else event by event (skipping damage with a warning)."""
    return load_frames_accounted(run_dir)[0]


def load_frames_accounted(run_dir: Path) -> tuple[RunFrames, Accounting | None]:
    """`load_frames`, and how plans and observations paired up where the fast path's first
    pass found it (`reports.line_accounting`; None: it takes reading the lines again)."""
    return_large_buffers()
    try:
        scan = rare_events(run_dir)
        frames = frames_from_events(scan.events)
        requests = request_frame(run_dir, scan)
    except SlowPathNeeded:
        return frames_from_events(read_journal(run_dir)), None
    scan.unknown.warn(warn_journal)  # only now: the slow path, had it been needed, warns on its own
    release_free_memory()
    _add_limit_ratios(requests, frames.run)
    return dataclasses.replace(frames, requests=requests), scan.accounting


def _add_limit_ratios(requests: pd.DataFrame, run: RunStarted | None) -> None:
    """Prompt size as a fraction of the pool and of the context limit (NaN when unknown)."""
    tokens = requests["num_prompt_tokens"].astype("float64")
    pool = run.limits.pool_tokens if run is not None and run.limits.pool_tokens > 0 else None
    context = (
        run.limits.context_tokens if run is not None and run.limits.context_tokens > 0 else None
    )
    requests["pool_ratio"] = tokens / pool if pool else float("nan")
    requests["context_ratio"] = tokens / context if context else float("nan")
