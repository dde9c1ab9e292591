"""The evidence pass: the plan and observation lines of the few requests findings name.

A request line is picked by its id's bytes where the line writes it (right after its
declared prefix, `harness.record.journal.REQUEST_LINE_PREFIXES`), a chunk of lines at a time
(`reports.journal_lines`), and only the lines picked are decoded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvcanary.harness.record.events import Event, ObservationRecorded, PlanRecorded
from kvcanary.harness.record.journal import RECORD_START, journal_segments
from kvcanary.reports.journal_lines import OBSERVATION, OTHER, PLAN, REQUEST_PREFIXES, Chunk, chunks
from kvcanary.reports.journal_scan import decode_line


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
                event = decode_line(chunk.line(index))
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
        if not line.startswith(RECORD_START) and line.strip():
            picked.append(index)
    return sorted(set(picked))


def _request_id(event: Event) -> str | None:
    if isinstance(event, PlanRecorded):
        return event.plan.request_id
    if isinstance(event, ObservationRecorded):
        return event.observation.request_id
    return None
