"""A soak's journal upkeep: at every rotation, the resume checkpoint, the closed segment
compressed, and the retention (`--keep-journal AGE|SIZE`).

The state a resume needs (`harness.run.resume_state`) is folded from every event the soak
journals, starting from what its journal held when it started; when the writer closes a
segment, that state is the fold through the closed segment exactly, and is saved as the
checkpoint. Then, in a worker thread: the closed segment is scanned for findings (a
segment with one is never deleted), the closed segments older than `COMPRESS_AFTER_S` are
gzipped (`harness.record.segments`), and the retention deletes the closed segments it
allows, oldest first. A night's soak therefore resumes in
about the time it takes to read one segment, and its disk holds what the retention keeps.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from kvcanary.harness.record.events import Event
from kvcanary.harness.record.journal import closed_segments
from kvcanary.harness.record.segments import (
    compress_segment,
    holds_a_finding,
    is_compressed,
    prune,
)
from kvcanary.harness.run.option_values import retention_limits
from kvcanary.harness.run.resume_state import ResumeState, save_checkpoint

_NUMBER = re.compile(r"\.(\d+)\.")
COMPRESS_AFTER_S = 600.0
"""A closed segment is gzipped at the first rotation after it is this old: the latest ones
stay plain, for `tail` and `grep` while a soak runs."""


class JournalUpkeep:
    """The upkeep of one soak session's journal (feed it every event journaled)."""

    def __init__(self, out_dir: Path, retention: str | None) -> None:
        self.out_dir = out_dir
        self.state = ResumeState.load(out_dir)  # what the journal holds so far
        self._max_age_s, self._max_bytes = retention_limits(retention)
        self._findings: dict[int, bool] = {}

    def feed(self, event: Event) -> None:
        self.state.feed(event)

    async def closed(self, segment: Path) -> list[Path]:
        """After the writer closed `segment`: checkpoint, compress, prune; what it deleted."""
        number = int(_NUMBER.findall(segment.name)[-1])
        snapshot = ResumeState.from_dict(self.state.to_dict())  # the fold through `segment`
        return await asyncio.to_thread(self._after_rotation, segment, number, snapshot)

    def _after_rotation(self, segment: Path, number: int, state: ResumeState) -> list[Path]:
        save_checkpoint(self.out_dir, number, state)  # it now covers `segment` exactly
        retained = self._max_age_s is not None or self._max_bytes is not None
        if retained:  # scanned while plain (and just written): the retention asks later
            self._findings[number] = holds_a_finding(segment)
        now = time.time()
        for _, path in closed_segments(self.out_dir):
            if not is_compressed(path) and now - path.stat().st_mtime > COMPRESS_AFTER_S:
                compress_segment(path)
        if not retained:
            return []

        def keep(candidate: int, path: Path) -> bool:
            if candidate > number:
                return True
            if candidate not in self._findings:  # closed by an earlier session
                self._findings[candidate] = holds_a_finding(path)
            return self._findings[candidate]

        segments = closed_segments(self.out_dir)
        return prune(segments, max_age_s=self._max_age_s, max_bytes=self._max_bytes, keep=keep)
