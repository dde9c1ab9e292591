"""`evidence/`: one JSON file per finding, with the plan and observation of its request.

An evidence file holds the finding (its excerpt already redacted by the detector) and, for
the finding's request and the victim's request, the plan and observation exactly as
journaled (sizes, canary spans, timestamps, status, usage, hashes) plus the derived figures
the report uses (outcome, TTFT, size against the limits). Response text is left out unless
the user asks for it: with `keep_raw_evidence` the finding's own response text is added
where the journal has it verbatim (observations journaled with `text_redacted = true` have
only the redacted text, and the file says so).

The journal records of those requests are collected by one more pass over the journal,
made only when there are findings: frames keep no per-request blobs, so a run of millions
of requests stays small in memory. Files are created 0600 in a 0700 directory, like the
journal. Each render replaces the evidence files of an earlier one, so re-rendering without
raw text really removes raw text an earlier render kept.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvcanary.harness.record.events import (
    Event,
    ObservationRecorded,
    PlanRecorded,
    plain,
    to_record,
)
from kvcanary.harness.record.outputs import EVIDENCE_DIR
from kvcanary.reports.findings import FindingView, iter_finding_views
from kvcanary.reports.frames import RunFrames

DERIVED_COLUMNS = ("outcome", "ttft_ms", "queue_ms", "total_ms", "pool_ratio", "context_ratio")
_EVIDENCE_FILE = re.compile(r"^\d{4,}-[a-z_]+-.*\.json$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_FILE_MODE = 0o600
_DIR_MODE = 0o700


@dataclass
class RequestRecords:
    """One request as journaled: its plan and observation records, text held apart."""

    plan: dict[str, Any] | None = None
    observation: dict[str, Any] | None = None
    text: str = field(default="", repr=False)
    text_redacted: bool = False


@dataclass(frozen=True, slots=True)
class EvidenceResult:
    paths: list[Path]
    num_raw_kept: int
    """Files that hold full response text."""
    num_raw_unavailable: int
    """Findings whose response text the journal holds only redacted (or not at all)."""


def named_request_ids(frames: RunFrames) -> set[str]:
    """Every request a finding names, as the responder or as the victim."""
    findings = frames.findings
    named = set(findings["request_id"].dropna()) | set(findings["victim_request_id"].dropna())
    return {str(request_id) for request_id in named}


def request_records(events: Iterable[Event], request_ids: set[str]) -> dict[str, RequestRecords]:
    """The journal records of the given requests, in one pass over the journal."""
    found: dict[str, RequestRecords] = {}
    for event in events:
        if isinstance(event, PlanRecorded) and event.plan.request_id in request_ids:
            record = to_record(event)
            record.pop("type")
            record.pop("canary_spans")  # packed in the journal; listed here, for people
            record["canaries"] = plain(event.plan.canaries)
            found.setdefault(event.plan.request_id, RequestRecords()).plan = record
        elif isinstance(event, ObservationRecorded) and event.observation.request_id in request_ids:
            observation = event.observation
            record = to_record(event)
            record.pop("type")
            record.pop("text")  # added back only on request, and only to the raw section
            entry = found.setdefault(observation.request_id, RequestRecords())
            entry.observation = record
            entry.text, entry.text_redacted = observation.text, observation.text_redacted
    return found


def write_evidence(
    frames: RunFrames,
    out_dir: Path,
    records: dict[str, RequestRecords],
    *,
    keep_raw: bool = False,
) -> EvidenceResult:
    """Write `out_dir/evidence/NNNN-<kind>-<request>.json` for every finding."""
    directory = out_dir / EVIDENCE_DIR
    directory.mkdir(mode=_DIR_MODE, exist_ok=True)
    directory.chmod(_DIR_MODE)
    for stale in directory.iterdir():
        if _EVIDENCE_FILE.match(stale.name):
            stale.unlink()
    if frames.findings.empty:
        return EvidenceResult([], 0, 0)
    derived = _derived(frames, set(records))
    paths, num_kept, num_unavailable = [], 0, 0
    for view in iter_finding_views(frames.findings):
        own = records.get(view.request_id) if view.request_id else None
        document: dict[str, Any] = {
            "run_id": frames.run.run_id if frames.run is not None else None,
            "finding": view.record(),
            "request": _request(view.request_id, records, derived),
            "victim_request": _request(view.victim_request_id, records, derived),
        }
        if keep_raw:
            document["raw_response"] = _raw_section(own)
            if own is not None and own.observation is not None and not own.text_redacted:
                num_kept += 1
            else:
                num_unavailable += 1
        path = directory / _file_name(view)
        _write_json(path, document)
        paths.append(path)
    return EvidenceResult(paths, num_kept, num_unavailable)


def _request(
    request_id: str | None,
    records: dict[str, RequestRecords],
    derived: dict[str, dict[str, Any]],
) -> dict[str, Any] | None:
    if request_id is None:
        return None
    entry = records.get(request_id, RequestRecords())
    return {
        "request_id": request_id,
        "plan": entry.plan,
        "observation": entry.observation,
        "derived": derived.get(request_id),
    }


def _raw_section(entry: RequestRecords | None) -> dict[str, Any]:
    if entry is None or entry.observation is None:
        return {"kept": False, "note": "the journal holds no observation for this request"}
    if entry.text_redacted:
        return {
            "kept": False,
            "note": "raw text unavailable: the journal holds only the redacted text",
            "redacted_text": entry.text,
        }
    return {"kept": True, "text": entry.text}


def _derived(frames: RunFrames, request_ids: set[str]) -> dict[str, dict[str, Any]]:
    """The report's derived figures for the given requests, by request id."""
    requests = frames.requests
    rows = requests.loc[requests["request_id"].isin(request_ids), ["request_id", *DERIVED_COLUMNS]]
    return {
        str(record.pop("request_id")): {str(key): _plain(value) for key, value in record.items()}
        for record in rows.to_dict("records")
    }


def _plain(value: Any) -> Any:
    if value is None or value is pd.NA:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def _file_name(view: FindingView) -> str:
    request = _UNSAFE_CHARS.sub("_", view.request_id or "run")[:80]
    return f"{view.number:04d}-{view.kind}-{request}.json"


def _write_json(path: Path, document: dict[str, Any]) -> None:
    text = json.dumps(document, indent=2, default=str) + "\n"
    # Created 0600 from the start: no moment where another user could open it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    os.fchmod(fd, _FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
