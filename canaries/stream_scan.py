"""The stream scanner: one response's chunks in, each hit out exactly once, with offsets into
the whole response, however the chunks split it (`canaries.index` describes the layers).

Memory is bounded: the scanner keeps a tail of HOLDBACK + MAX_MATCH characters and scans
once `scan_block` new characters have arrived (SCAN_BLOCK, 32 KiB, by default), so hits
arrive once enough text follows them, or at `finish()`. It knows nothing about what a hit
means; the index it scans with finds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.hit import Hit

if TYPE_CHECKING:
    from kvcanary.canaries.index import CanaryIndex

HOLDBACK = 512
MAX_MATCH = 512
CONTEXT = 16
SCAN_BLOCK = 1 << 15

Find = Callable[[str, int, int, int], list[Hit]]
"""The index's search: hits in a buffer (first character at absolute offset `base`) that
end in (after, until]."""


class StreamScanner:
    """Scans one streamed response; `feed` chunks as they arrive, then `finish`."""

    def __init__(
        self,
        index: CanaryIndex,
        *,
        scan_block: int = SCAN_BLOCK,
        reference: bool = False,
        exact_only: bool = False,
    ) -> None:
        if scan_block < 1:
            raise CanaryError(f"scan_block must be positive, got {scan_block}")
        self._index = index
        self._find: Find
        if exact_only:
            self._find = index._find_oracle_exact if reference else index._find_exact
        else:
            self._find = index._find_oracle if reference else index._find
        self._scan_block = scan_block
        self._tail = " "  # a separator before the response's first character
        self._base = -1  # absolute offset of _tail[0]
        self._pending: list[str] = []
        self._num_pending = 0
        self._decided = -1  # hits ending at or before this offset have been reported
        self._finished = False
        self.num_chars = 0

    @property
    def num_buffered(self) -> int:
        """Characters held back for matches that may still complete (bounded)."""
        return len(self._tail) + self._num_pending

    def feed(self, chunk: str) -> list[Hit]:
        """Hits that this chunk completed (possibly of earlier chunks' text)."""
        if self._finished:
            raise CanaryError("feed() after finish()")
        if chunk:
            self._pending.append(chunk)
            self._num_pending += len(chunk)
            self.num_chars += len(chunk)
        if self._num_pending < self._scan_block:
            return []
        return self._scan(final=False)

    def finish(self) -> list[Hit]:
        """The remaining hits, at the end of the response."""
        if self._finished:
            return []
        self._finished = True
        self._pending.append(" ")  # a separator after the last character
        return self._scan(final=True)

    def _scan(self, *, final: bool) -> list[Hit]:
        buffer = self._tail + "".join(self._pending)
        self._pending, self._num_pending = [], 0
        end = self._base + len(buffer)
        until = end - 1 if final else end - HOLDBACK  # final: all but the added separator
        hits = self._find(buffer, self._base, self._decided, until)
        self._decided = max(self._decided, until)
        keep = HOLDBACK + MAX_MATCH + CONTEXT
        if len(buffer) > keep:
            self._tail, self._base = buffer[-keep:], end - keep
        else:
            self._tail = buffer
        return hits
