"""A journal's raw lines in large chunks, as numpy arrays: where each line starts and ends,
which lines are plans or observations, and 64-bit hashes of byte strings, vectorised.

`reports.journal_scan` reads a million-request journal through these instead of a Python
loop over its two million lines: a chunk of `CHUNK_BYTES` is one `read`, its line ends one
`numpy.flatnonzero`, and a line's kind a comparison of the fixed-width window at its start
against the two request prefixes the journal declares (`harness.record.journal.
REQUEST_LINE_PREFIXES`). Nothing here decodes JSON or makes a Python object per line.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvcanary.harness.record.events import OBSERVATION_RECORD, PLAN_RECORD
from kvcanary.harness.record.journal import REQUEST_LINE_PREFIXES
from kvcanary.harness.record.segments import open_segment, segment_size

CHUNK_BYTES = 8 << 20
"""Bytes read at a time; a longer line is read whole (the chunk grows to hold it)."""
PLAN_PREFIX = REQUEST_LINE_PREFIXES[PLAN_RECORD]
OBSERVATION_PREFIX = REQUEST_LINE_PREFIXES[OBSERVATION_RECORD]
REQUEST_PREFIXES = (PLAN_PREFIX, OBSERVATION_PREFIX)
PLAN, OBSERVATION, OTHER = 1, 2, 0
"""Line kinds: a line that starts with `PLAN_PREFIX`, with `OBSERVATION_PREFIX`, or neither."""
_WINDOW = max(len(prefix) for prefix in REQUEST_PREFIXES)
_PREFIXES = [
    (kind, np.frombuffer(prefix, np.uint8))
    for kind, prefix in ((PLAN, PLAN_PREFIX), (OBSERVATION, OBSERVATION_PREFIX))
]
_NEWLINE, _BRACE = ord("\n"), ord("}")

Int64s = npt.NDArray[np.int64]


class SlowPathNeeded(Exception):
    """This journal must be read event by event (`reports.journal_scan`): a corrupt or torn
    line, a record that does not decode, a newer schema, a request id planned twice."""


@dataclass(frozen=True)
class Chunk:
    """Whole lines of a file: `data[starts[i]:ends[i]]` is line i (with its newline, except
    a last line that has none), `offset` where `data` starts in the file. `data` may go on
    past the last line (the start of the next, read again with the next chunk). `data` is
    the reader's buffer, reused: a chunk is valid until the next one is read."""

    data: bytearray
    offset: int
    starts: Int64s
    ends: Int64s

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        return np.frombuffer(self.data, np.uint8, int(self.ends[-1]))

    def line(self, index: int) -> bytes:
        return bytes(self.data[self.starts[index] : self.ends[index]])

    def kinds(self) -> npt.NDArray[np.int8]:
        """`PLAN`, `OBSERVATION` or `OTHER` for each line."""
        kinds = np.full(len(self.starts), OTHER, np.int8)
        lengths = self.ends - self.starts
        long_enough = np.flatnonzero(lengths >= _WINDOW)
        if len(long_enough):
            windows = np.lib.stride_tricks.sliding_window_view(self.array, _WINDOW)
            heads = windows[self.starts[long_enough]]
            for kind, prefix in _PREFIXES:
                kinds[long_enough[(heads[:, : len(prefix)] == prefix).all(axis=1)]] = kind
        for index in np.flatnonzero(lengths < _WINDOW).tolist():  # short: one at a time
            line = self.line(index)
            for kind, written in zip((PLAN, OBSERVATION), REQUEST_PREFIXES, strict=True):
                if line.startswith(written):
                    kinds[index] = kind
        return kinds

    def well_ended(self) -> npt.NDArray[np.bool_]:
        """Lines that end with `}` and a newline, as `encode_event` ends every record."""
        array = self.array
        well = self.ends - self.starts >= 2
        ends = self.ends[well]
        well[well] = (array[ends - 1] == _NEWLINE) & (array[ends - 2] == _BRACE)
        return well


def chunks(path: Path, num_bytes: int | None = None) -> Iterator[Chunk]:
    """The first `num_bytes` of `path` (all of it when None) in chunks of whole lines."""
    end = segment_size(path) if num_bytes is None else num_bytes
    offset = 0
    buffer = bytearray(CHUNK_BYTES)
    with open_segment(path) as handle:  # compressed or not (`harness.record.segments`)
        while offset < end:
            handle.seek(offset)
            num = handle.readinto(memoryview(buffer)[: min(len(buffer), end - offset)])
            if not num:  # the file is shorter than it was
                return
            data = buffer
            if offset + num < end:
                cut = data.rfind(b"\n", 0, num) + 1
                if cut == 0:  # no whole line yet: read more at once
                    buffer = bytearray(2 * len(buffer))
                    continue
            else:  # the end: a last line without a newline is a line too
                cut = num
            array = np.frombuffer(data, np.uint8, cut)
            ends = np.flatnonzero(array == _NEWLINE) + 1
            if not len(ends) or ends[-1] != cut:
                ends = np.append(ends, cut)
            starts = np.empty_like(ends)
            starts[0], starts[1:] = 0, ends[:-1]
            yield Chunk(data, offset, starts, ends)
            offset += cut


_K0 = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)
_S31, _S27, _S30 = np.uint64(31), np.uint64(27), np.uint64(30)
LONG_BYTES = 256
"""Strings longer than this are hashed one at a time (a block's window is its longest)."""


def hash_slices(
    data: npt.NDArray[np.uint8], starts: Int64s, lengths: Int64s
) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of each byte string `data[start:start + length]`: the same bytes give
    the same hash whatever else is hashed with them. Eight bytes at a time, each word
    mixed in with splitmix64's finaliser; the length is mixed in first."""
    hashes = np.empty(len(starts), np.uint64)
    long = lengths > LONG_BYTES
    short = np.flatnonzero(~long)
    hashes[short] = _hash_short(data, starts[short], lengths[short])
    for index in np.flatnonzero(long):
        hashes[index] = _hash_short(data, starts[index : index + 1], lengths[index : index + 1])[0]
    return hashes


def _hash_short(
    data: npt.NDArray[np.uint8], starts: Int64s, lengths: Int64s
) -> npt.NDArray[np.uint64]:
    hashes = _mix(lengths.astype(np.uint64) ^ _K0)
    if not len(starts):
        return hashes
    width = max(8, -(-int(lengths.max()) // 8) * 8)
    padded = np.concatenate([data, np.zeros(width, np.uint8)])
    words = np.lib.stride_tricks.sliding_window_view(padded, width)[starts].view("<u8")
    for column in range(width // 8):
        left = lengths - 8 * column  # bytes of this word that belong to the string
        word = words[:, column] & _LOW_BYTES[np.clip(left, 0, 8)]
        hashes = np.where(left > 0, _mix(hashes ^ word) * _K0, hashes)
    return _mix(hashes)


_LOW_BYTES = np.array([(1 << (8 * num)) - 1 for num in range(9)], np.uint64)
"""The low `num` bytes of a little-endian word."""


def _mix(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    values = (values ^ (values >> _S30)) * _K1
    values = (values ^ (values >> _S27)) * _K2
    mixed: npt.NDArray[np.uint64] = values ^ (values >> _S31)
    return mixed
