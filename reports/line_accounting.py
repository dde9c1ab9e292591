"""The accounting of `reports.accounting`, computed in the report's first pass over the lines.

`kvcanary report` verifies that every plan was observed exactly once (`reports.accounting`).
Reading every line again for it was a second full pass over the journal (6 s and more than
100 MB of ids at 10^6 requests). Here the first pass (`reports.journal_scan.rare_events`)
hands each chunk's request lines over as it scans them: their request ids are hashed where
the line writes them (`journal_lines.hash_slices`, vectorised), with the session each line
belongs to (the `run_started` lines before it) and its position. At the end the pairing is a
few sorts: a plan planned once, observed once, later in its own session, is what a journal
of finished sessions holds, and that is the accounting. Anything else (a request planned
twice, a plan lost to a crash or never observed, an id written with an escape) needs the
ids named: `result` is then None and the exact line-by-line pass runs, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.reports.accounting import Accounting
from kvcanary.reports.journal_lines import (
    OBSERVATION,
    OBSERVATION_PREFIX,
    PLAN,
    PLAN_PREFIX,
    Chunk,
    hash_slices,
)

_QUOTE, _BACKSLASH = ord('"'), ord("\\")


class LineTally:
    """Request lines' id hashes, sessions and positions, a chunk at a time: `chunk` starts
    one, `started` / `finished` tell a rare line's effect (taking the request lines before
    it), `end_chunk` takes the rest, all in line order."""

    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[npt.NDArray[Any], ...]]] = {PLAN: [], OBSERVATION: []}
        self._ended: list[bool] = [False]  # session 0: lines before the first run_started
        self._num_lines = 0
        self._chunk: tuple[Chunk, npt.NDArray[np.int8], npt.NDArray[np.int64]] | None = None
        self._quotes: npt.NDArray[np.int64] = np.empty(0, np.int64)
        self._taken = 0
        self.exact = True
        """False once an id needs the exact pass (written with an escape)."""

    def chunk(
        self, chunk: Chunk, kinds: npt.NDArray[np.int8], requests: npt.NDArray[np.bool_]
    ) -> None:
        """A new chunk; `requests` marks its well-formed plan and observation lines."""
        self._chunk = (chunk, kinds, np.flatnonzero(requests))
        self._quotes = np.flatnonzero(chunk.array == _QUOTE)
        self._taken = 0

    def end_chunk(self) -> None:
        """The chunk's last request lines (before its buffer is read over)."""
        assert self._chunk is not None
        self.until(len(self._chunk[0].starts))
        self._num_lines += len(self._chunk[0].starts)
        self._chunk = None

    def until(self, index: int) -> None:
        """Take the current chunk's request lines before line `index`."""
        assert self._chunk is not None
        chunk, kinds, lines = self._chunk
        lines = lines[(lines >= self._taken) & (lines < index)]
        self._taken = max(self._taken, index)
        array, quotes = chunk.array, self._quotes
        for kind, prefix in ((PLAN, PLAN_PREFIX), (OBSERVATION, OBSERVATION_PREFIX)):
            mine = lines[kinds[lines] == kind]
            if not len(mine):
                continue
            starts = chunk.starts[mine] + len(prefix)
            ends = quotes[np.minimum(np.searchsorted(quotes, starts), max(len(quotes) - 1, 0))]
            if np.any(ends < starts) or np.any(array[ends - 1] == _BACKSLASH):
                self.exact = False
            hashes = hash_slices(array, starts, ends - starts)
            session = np.full(len(mine), len(self._ended) - 1, np.int64)
            self._parts[kind].append((hashes, session, self._num_lines + mine))

    def started(self, index: int) -> None:
        """Line `index` of the current chunk is a `run_started`: a session begins after it."""
        self.until(index)
        self._ended.append(False)

    def finished(self, index: int) -> None:
        """Line `index` of the current chunk is a `run_finished`: the session ended."""
        self.until(index)
        self._ended[-1] = True

    def result(self) -> Accounting | None:
        """The accounting, when every plan was observed once in its session; else None."""
        if not self.exact:
            return None
        plan_hashes, plan_sessions, plan_positions = self._columns(PLAN)
        observed_hashes, observed_sessions, observed_positions = self._columns(OBSERVATION)
        if len(plan_hashes) != len(observed_hashes) or (plan_sessions == 0).any():
            return None  # lost, unobserved, unplanned, observed twice; lines before a start
        order = np.argsort(plan_hashes, kind="stable")
        hashes = plan_hashes[order]
        if len(hashes) > 1 and np.any(hashes[1:] == hashes[:-1]):
            return None  # planned twice
        at = np.minimum(np.searchsorted(hashes, observed_hashes), max(len(hashes) - 1, 0))
        plan = order[at] if len(order) else at
        paired = (
            (hashes[at] == observed_hashes)
            & (plan_sessions[plan] == observed_sessions)
            & (plan_positions[plan] < observed_positions)
        )
        if not bool(np.all(paired)) or len(np.unique(plan)) != len(plan):
            return None
        sessions = self._ended[1:]
        return Accounting(
            num_sessions=len(sessions),
            num_plans=len(plan_hashes),
            num_observations=len(observed_hashes),
            lost_to_crash=(),
            unobserved=(),
            observed_twice=(),
            planned_twice=(),
            unplanned=(),
            num_unended_sessions=sum(not ended for ended in sessions),
        )

    def _columns(self, kind: int) -> tuple[npt.NDArray[Any], ...]:
        parts = self._parts.pop(kind)
        empty = (np.empty(0, np.uint64), np.empty(0, np.int64), np.empty(0, np.int64))
        if not parts:
            return empty
        return tuple(np.concatenate(column) for column in zip(*parts, strict=True))
