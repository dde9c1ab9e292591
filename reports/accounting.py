"""Every planned request accounted for: the journal invariant `kvcanary report` verifies.

The runner journals a `plan` before it sends a request and exactly one `observation` after
(a keep-alive retry is the observation's `retry` field, never a second observation; a
request cancelled by Ctrl-C or SIGTERM is observed as `cancelled`). So, per session (from one
`run_started` to the next):

- a session that ended (`run_finished`) observed each of its plans exactly once;
- a session that did not end was killed (SIGKILL, OOM, power): its plans still in flight have
  no observation, and are *lost to the crash*: expected, counted, not a defect;
- no request id is planned twice, and no observation lacks a plan;
- a line that is not a whole record is a *torn line* (a kill mid-write), counted.

A violation is a defect of kvcanary itself, and the report says which ids. The scan reads
only each line's head (`{"type":"plan","request_id":...`, as `harness.record.journal`
declares it writes it), so it costs far less than the report itself; a line written
differently is parsed whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcanary.harness.record.journal import RECORD_START, closed_segments, journal_segments
from kvcanary.harness.record.segments import open_segment

_HEAD = re.compile(re.escape(RECORD_START) + rb'(\w+)"(?:,"request_id":"((?:[^"\\]|\\.)*)")?')
"""A line's head as `encode_event` declares it writes (`RECORD_START`, the type, and for a
request record its id: `REQUEST_LINE_PREFIXES`)."""
_ACCOUNTED = (b"plan", b"observation")
MAX_IDS_SHOWN = 5


@dataclass(frozen=True, slots=True)
class Accounting:
    """How the journal's plans and observations pair up."""

    num_sessions: int
    num_plans: int
    num_observations: int
    lost_to_crash: tuple[str, ...]
    """Plans of a session that never ended, without an observation (in flight at the kill)."""
    unobserved: tuple[str, ...]
    """Plans of a session that ended, without an observation: a defect."""
    observed_twice: tuple[str, ...]
    """Request ids with more than one observation: a defect."""
    planned_twice: tuple[str, ...]
    """Request ids planned more than once (numbering must continue on resume): a defect."""
    unplanned: tuple[str, ...]
    """Observations without a plan before them: a defect."""
    num_torn_lines: int = 0
    num_unended_sessions: int = 0

    @property
    def consistent(self) -> bool:
        """Every plan observed exactly once, but for those a crash lost."""
        return not (self.unobserved or self.observed_twice or self.planned_twice or self.unplanned)

    def problems(self) -> list[str]:
        """One line per kind of violation, naming the first few request ids."""
        kinds = [
            (self.unobserved, "planned in a session that ended but never observed"),
            (self.observed_twice, "observed more than once"),
            (self.planned_twice, "planned more than once"),
            (self.unplanned, "observed without a plan"),
        ]
        return [f"{len(ids)} request(s) {what}: {_some(ids)}" for ids, what in kinds if ids]

    def describe(self) -> str:
        """One line: what was planned, observed, lost and torn."""
        line = (
            f"journal: {self.num_plans} planned, {self.num_observations} observed in "
            f"{self.num_sessions} session(s)"
        )
        if self.lost_to_crash:
            line += (
                f"; {len(self.lost_to_crash)} in flight when {self.num_unended_sessions} "
                "session(s) were killed (no observation)"
            )
        if self.num_torn_lines:
            line += f"; {self.num_torn_lines} torn line(s) skipped"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "consistent": self.consistent,
            "num_sessions": self.num_sessions,
            "num_plans": self.num_plans,
            "num_observations": self.num_observations,
            "num_lost_to_crash": len(self.lost_to_crash),
            "num_torn_lines": self.num_torn_lines,
            "problems": self.problems(),
        }


def account_requests(run_dir: Path | str) -> Accounting:
    """Pair the plans and observations of the journal in `run_dir` (all its segments). Where
    a soak's retention deleted segments (`--keep-journal`: their numbers have gaps), a plan
    or an observation whose partner was in a deleted segment is expected, not a defect."""
    accounting = account_lines(_lines(journal_segments(run_dir)))
    numbers = [number for number, _ in closed_segments(run_dir)]
    if numbers != list(range(1, len(numbers) + 1)):
        return dataclasses.replace(accounting, unobserved=(), unplanned=())
    return accounting


def account_lines(lines: Iterable[bytes]) -> Accounting:
    """`account_requests` over journal lines (each with or without its newline)."""
    tally = _Tally()
    for line in lines:
        head = _head(line)
        if head is None:
            tally.num_torn += bool(line.strip())
            continue
        kind, request_id = head
        if kind == b"run_started":
            tally.end_session()
        elif kind == b"run_finished":
            tally.ended = True
        elif kind == b"plan" and request_id is not None:
            tally.plan(request_id)
        elif kind == b"observation" and request_id is not None:
            tally.observe(request_id)
    tally.end_session()
    return tally.result()


class _Tally:
    """The running pairing; only plans not yet observed are held per session."""

    def __init__(self) -> None:
        self.num_sessions = self.num_plans = self.num_observations = 0
        self.num_torn = self.num_unended = 0
        self.started = False
        self.ended = False
        self.pending: dict[bytes, None] = {}  # this session's plans awaiting their observation
        self.planned: set[bytes] = set()
        self.observed: set[bytes] = set()
        self.lost: list[bytes] = []
        self.unobserved: list[bytes] = []
        self.observed_twice: list[bytes] = []
        self.planned_twice: list[bytes] = []
        self.unplanned: list[bytes] = []

    def end_session(self) -> None:
        """Close the session so far (at the next `run_started`, or at the end)."""
        if self.started or self.pending:
            self.num_sessions += 1
            if not self.ended:
                self.num_unended += 1
            (self.unobserved if self.ended else self.lost).extend(self.pending)
        self.pending = {}
        self.started, self.ended = True, False

    def plan(self, request_id: bytes) -> None:
        self.num_plans += 1
        if request_id in self.planned:
            self.planned_twice.append(request_id)
        self.planned.add(request_id)
        self.pending[request_id] = None

    def observe(self, request_id: bytes) -> None:
        self.num_observations += 1
        if request_id in self.observed:
            self.observed_twice.append(request_id)
        elif request_id not in self.pending:
            self.unplanned.append(request_id)
        self.observed.add(request_id)
        self.pending.pop(request_id, None)

    def result(self) -> Accounting:
        return Accounting(
            num_sessions=self.num_sessions,
            num_plans=self.num_plans,
            num_observations=self.num_observations,
            lost_to_crash=_ids(self.lost),
            unobserved=_ids(self.unobserved),
            observed_twice=_ids(self.observed_twice),
            planned_twice=_ids(self.planned_twice),
            unplanned=_ids(self.unplanned),
            num_torn_lines=self.num_torn,
            num_unended_sessions=self.num_unended,
        )


def _head(line: bytes) -> tuple[bytes, bytes | None] | None:
    """(record type, request id) of a whole record line; None for a torn or corrupt one."""
    stripped = line.rstrip()
    if not (stripped.startswith(b"{") and stripped.endswith(b"}")):
        return None
    match = _HEAD.match(stripped)
    if match is not None and (match.group(2) is not None or match.group(1) not in _ACCOUNTED):
        return match.group(1), match.group(2)
    try:  # written in another field order (or not a record at all): read it whole
        record = json.loads(stripped)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the stack
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    request_id = record.get("request_id")
    encoded = json.dumps(request_id)[1:-1].encode() if isinstance(request_id, str) else None
    return record["type"].encode(), encoded


def _lines(segments: Iterable[Path]) -> Iterable[bytes]:
    for segment in segments:
        with open_segment(segment) as f:
            yield from f


def _ids(raw: list[bytes]) -> tuple[str, ...]:
    return tuple(_id(r) for r in raw)


def _id(raw: bytes) -> str:
    """A request id as the line wrote it (JSON-escaped), or as its bytes where a damaged line
    wrote no valid JSON string."""
    try:
        decoded = json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "backslashreplace")
    return decoded if isinstance(decoded, str) else raw.decode("utf-8", "backslashreplace")


def _some(ids: tuple[str, ...]) -> str:
    shown = ", ".join(ids[:MAX_IDS_SHOWN])
    return shown + (f" and {len(ids) - MAX_IDS_SHOWN} more" if len(ids) > MAX_IDS_SHOWN else "")
