"""The run journal: append-only JSON Lines of `harness.record.events` records, and its reader.

What it knows:

- **Durability.** Every event becomes one line, written with a single `os.write` on an
  `O_APPEND` descriptor, so it is in the kernel the moment `write` returns: a killed process
  (SIGKILL, OOM) loses only the requests still in flight. `fsync` is what protects against a
  machine crash or power loss, and it costs milliseconds on real disks, so it is rate-limited:
  at most once every `fsync_interval_s` (default 1 s) on ordinary events, and immediately on
  run start, phase changes, findings, run end, rotation and close. A power cut can therefore
  lose at most the last second of observations, never a finding or a phase boundary.
- **Privacy.** Journals may hold evidence (other tenants' text), so every segment is created
  with mode 0600 and forced back to 0600 when an existing one is reopened; a new run
  directory is created 0700.
- **Resume.** The writer opens in append mode. If the previous writer died mid-line, a newline
  is written first so the torn line stays a single bad line instead of corrupting the next
  record.
- **Segments.** The current segment is always `<stem><suffix>` (`journal.jsonl`, the file the
  run output contract names). `rotate()` renames it to `<stem>.NNNN<suffix>`
  (`journal.0001.jsonl`, `journal.0002.jsonl`, ... - numbered from 1, zero-padded to four
  digits, more digits past 9999) and starts a fresh current segment. Reading order is the
  numbered segments by number, then the current one. `max_segment_bytes` rotates
  automatically for soaks.
- **Reading.** `read_journal` yields events from all segments in order. It never raises on
  bad content: a torn last line (a crash mid-write) or a corrupt line is skipped with a
  `JournalWarning`, and a record type or shape this version does not understand (a journal
  from a newer kvcanary) is skipped with a warning too.

What it deliberately does not know: what the events mean (`harness.record.events` is the schema),
and who consumes them (reports, the progress display).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.decoding import RecordError, UnknownFields
from kvcanary.harness.record.events import (
    SCHEMA_VERSION,
    Event,
    FindingRecorded,
    PhaseStarted,
    RunFinished,
    RunStarted,
    from_record,
)
from kvcanary.harness.record.line_encoding import RECORD_START as RECORD_START
from kvcanary.harness.record.line_encoding import (
    REQUEST_LINE_PREFIXES as REQUEST_LINE_PREFIXES,
)
from kvcanary.harness.record.line_encoding import encode_event as encode_event
from kvcanary.harness.record.outputs import JOURNAL_NAME as JOURNAL_NAME
from kvcanary.harness.record.segments import (
    COMPRESSED_SUFFIX,
    fsync_dir,
    is_compressed,
    open_segment,
)

_FILE_MODE = 0o600
_DIR_MODE = 0o700
_SEGMENT_DIGITS = 4
# Events a person would hate to lose after a power cut: fsync'd as soon as they are written.
_DURABLE_NOW = (RunStarted, PhaseStarted, FindingRecorded, RunFinished)


class JournalWarning(UserWarning):
    """A journal line was skipped while reading (torn, corrupt, or from a newer version)."""


class JournalWriter:
    """Appends events to a run's journal, one flushed line each; safe across threads."""

    def __init__(
        self,
        path: Path | str,
        *,
        fsync_interval_s: float = 1.0,
        max_segment_bytes: int | None = None,
    ) -> None:
        if fsync_interval_s < 0:
            raise ConfigError(f"fsync interval must be >= 0 seconds, got {fsync_interval_s}")
        if max_segment_bytes is not None and max_segment_bytes <= 0:
            raise ConfigError(f"max segment size must be positive, got {max_segment_bytes}")
        self.path = Path(path)
        self.fsync_interval_s = fsync_interval_s
        self.max_segment_bytes = max_segment_bytes
        self.num_events = 0
        self._lock = threading.Lock()
        self._last_fsync = time.monotonic()
        self._dirty = False
        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, mode=_DIR_MODE)
        self._fd: int | None = None
        self._segment_bytes = 0
        self._open_current()

    # -- public -------------------------------------------------------------------------

    def write(self, event: Event, line: bytes | None = None) -> None:
        """Append one event; it is in the kernel (and survives a process kill) on return.
        `line`: the event already encoded (`encode_event`, in the process that saw it)."""
        line = encode_event(event) if line is None else line
        with self._lock:
            fd = self._require_open()
            if (
                self.max_segment_bytes is not None
                and self._segment_bytes > 0
                and self._segment_bytes + len(line) > self.max_segment_bytes
            ):
                self._rotate_locked()
                fd = self._require_open()
            _write_all(fd, line)
            self._segment_bytes += len(line)
            self.num_events += 1
            self._dirty = True
            now = time.monotonic()
            if isinstance(event, _DURABLE_NOW) or now - self._last_fsync >= self.fsync_interval_s:
                self._fsync_locked(now)

    def sync(self) -> None:
        """Force everything written so far to stable storage."""
        with self._lock:
            if self._fd is not None:
                self._fsync_locked(time.monotonic())

    def rotate(self) -> Path:
        """Close the current segment as `<stem>.NNNN<suffix>` and start a new current one.

        Returns the path the finished segment now has.
        """
        with self._lock:
            self._require_open()
            return self._rotate_locked()

    def segments(self) -> list[Path]:
        """All segments of this journal in reading order (numbered ones, then the current)."""
        return journal_segments(self.path)

    def close(self) -> None:
        """Sync and close; further writes raise. Closing twice is harmless."""
        with self._lock:
            if self._fd is None:
                return
            self._fsync_locked(time.monotonic())
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals (called with the lock held) ------------------------------------------

    def _open_current(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _FILE_MODE)
        os.fchmod(fd, _FILE_MODE)  # an existing segment may have been created more open
        size = os.fstat(fd).st_size
        if size > 0 and _last_byte(self.path) != b"\n":
            # A previous writer died mid-line: isolate the torn line so the next record is whole.
            _write_all(fd, b"\n")
            size += 1
        self._fd = fd
        self._segment_bytes = size

    def _require_open(self) -> int:
        if self._fd is None:
            raise ValueError(f"journal {self.path} is closed")
        return self._fd

    def _fsync_locked(self, now: float) -> None:
        assert self._fd is not None
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_fsync = now

    def _rotate_locked(self) -> Path:
        assert self._fd is not None
        self._dirty = True
        self._fsync_locked(time.monotonic())
        os.close(self._fd)
        self._fd = None
        numbered = _numbered_segments(self.path)
        number = numbered[-1][0] + 1 if numbered else 1
        target = self.path.with_name(
            f"{_stem(self.path)}.{number:0{_SEGMENT_DIGITS}d}{self.path.suffix}"
        )
        os.rename(self.path, target)
        fsync_dir(self.path.parent)
        self._open_current()
        return target


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _stem(path: Path) -> str:
    return path.name[: -len(path.suffix)] if path.suffix else path.name


def _numbered_segments(current: Path) -> list[tuple[int, Path]]:
    """(number, path) of the closed segments, plain or compressed (`harness.record.segments`;
    the plain one where a crash left both)."""
    if not current.parent.is_dir():
        return []
    pattern = re.compile(
        rf"^{re.escape(_stem(current))}\.(\d{{{_SEGMENT_DIGITS},}}){re.escape(current.suffix)}"
        rf"(?:{re.escape(COMPRESSED_SUFFIX)})?$"
    )
    found: dict[int, Path] = {}
    for child in current.parent.iterdir():
        match = pattern.match(child.name)
        if match and child.is_file():
            number = int(match.group(1))
            if number not in found or not is_compressed(child):
                found[number] = child
    return sorted(found.items())


def closed_segments(run_dir_or_path: Path | str) -> list[tuple[int, Path]]:
    """(number, path) of a journal's closed (rotated) segments, in reading order."""
    path = Path(run_dir_or_path)
    return _numbered_segments(path / JOURNAL_NAME if path.is_dir() else path)


def journal_segments(run_dir_or_path: Path | str) -> list[Path]:
    """The segment files of a journal, in reading order.

    Accepts a run directory (its `journal.jsonl` is the current segment) or the path of a
    current segment. Rotated segments without a current one are still returned.
    """
    path = Path(run_dir_or_path)
    current = path / JOURNAL_NAME if path.is_dir() else path
    segments = [p for _, p in _numbered_segments(current)]
    if current.is_file():
        segments.append(current)
    return segments


def read_journal(run_dir_or_path: Path | str, *, after: int = 0) -> Iterator[Event]:
    """Yield every event of a journal, all segments in order, skipping damage with a warning;
    with `after`, only those of the segments numbered above it and of the current one.

    A record with fields this version does not know is kept (they are dropped), with one
    warning per unknown field name for the whole journal. Raises `ConfigError` if there is
    no journal there at all; never raises on its content.
    """
    segments = journal_segments(run_dir_or_path)
    if not segments:
        raise ConfigError(f"no journal found at {run_dir_or_path} (expected {JOURNAL_NAME})")
    if after:
        skipped = {path for number, path in closed_segments(run_dir_or_path) if number <= after}
        segments = [segment for segment in segments if segment not in skipped]
    unknown = UnknownFields()
    for index, segment in enumerate(segments):
        yield from _read_segment(segment, unknown, is_last_segment=index == len(segments) - 1)


def _read_segment(path: Path, unknown: UnknownFields, *, is_last_segment: bool) -> Iterator[Event]:
    with open_segment(path) as f:
        lines = iter(f)
        line_no = 0
        pending = next(lines, None)
        while pending is not None:
            line_no += 1
            following = next(lines, None)
            torn = not pending.endswith(b"\n")
            event = parse_line(
                pending,
                where=f"{path.name}:{line_no}",
                unknown=unknown,
                torn_tail=torn and following is None and is_last_segment,
            )
            if event is not None:
                yield event
            pending = following


def parse_line(
    raw: bytes, *, where: str, unknown: UnknownFields, torn_tail: bool = False
) -> Event | None:
    """The event of one journal line, or None (with a warning) for a line that is not one."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        if torn_tail:
            warn_journal(f"{where}: skipped a truncated last line (the run was killed mid-write)")
        else:
            warn_journal(f"{where}: skipped a corrupt line ({len(raw)} bytes)")
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        warn_journal(f"{where}: skipped a line that is not a journal record")
        return None
    names: set[str] = set()
    try:
        event = from_record(record, names)
    except RecordError as exc:
        warn_journal(
            f"{where}: skipped a {record['type'][:40]!r} record this version cannot read: {exc}"
        )
        return None
    unknown.note(names, where)
    unknown.warn(warn_journal)
    if isinstance(event, RunStarted) and event.schema > SCHEMA_VERSION:
        warn_journal(
            f"{where}: journal schema {event.schema} is newer than this kvcanary's "
            f"({SCHEMA_VERSION}); unknown records will be skipped"
        )
    return event


def warn_journal(message: str) -> None:
    """Say a `JournalWarning` (what a reader skipped or dropped, and where)."""
    warnings.warn(message, JournalWarning, stacklevel=3)
