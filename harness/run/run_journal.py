"""The journal as a run writes it: each event shown on the progress display as it is written,
and `run_finished` held back until the run's last phase is over.

A runner journals its own `run_finished` when its workload ends, but a run can go on after
that: the cache probe follows the workload, and a scenario's next step follows the last. So
`run_finished` is held and written by `finish` (or, at the latest, by `close`), stamped when
the run really ended: everything the run sent comes before it, and summary.json's duration
counts all of it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from kvcanary.canaries.errors import RunIncomplete
from kvcanary.harness.record.events import Event, RunFinished
from kvcanary.harness.record.journal import JOURNAL_NAME, JournalWriter
from kvcanary.harness.run.progress import ProgressDisplay


class Journal:
    """The run's journal, with each event also shown on the progress display."""

    def __init__(self, out_dir: Path, display: ProgressDisplay) -> None:
        try:
            self._writer = JournalWriter(out_dir / JOURNAL_NAME)
        except OSError as exc:
            raise RunIncomplete(f"cannot create the journal in {out_dir}: {exc}") from None
        self._display = display
        self._broken: str | None = None
        self._listeners: list[Callable[[Event], None]] = []
        self._finished: RunFinished | None = None
        """The latest `run_finished` emitted, held until `finish`."""
        self._ended = False

    @property
    def path(self) -> Path:
        return self._writer.path

    def listen(self, listener: Callable[[Event], None]) -> None:
        """Also give every event journaled from now on to `listener` (the metrics)."""
        self._listeners.append(listener)

    @property
    def writer(self) -> JournalWriter:
        return self._writer

    @property
    def finished(self) -> RunFinished | None:
        """The `run_finished` held back (the latest one emitted), if any."""
        return self._finished

    def emit(self, event: Event, line: bytes | None = None) -> None:
        """Journal `event` (`line`: already encoded, by the Ray actor that saw it); a
        `run_finished` is held until `finish`. A journal that cannot be written (disk full,
        the directory gone) stops the run with one line (`RunIncomplete`, exit 3); later
        events are dropped."""
        if isinstance(event, RunFinished):
            self._finished = event
            return
        self._write(event, line)

    def finish(
        self,
        event: RunFinished | None = None,
        *,
        num_more_requests: int = 0,
        reason: str | None = None,
    ) -> None:
        """Journal the run's end now: `event`, else the held `run_finished` stamped now, with
        `num_more_requests` (sent after the runner ended) added and `reason` where given.
        Once only."""
        if self._ended:
            return
        held, self._finished = self._finished, None
        if event is None and held is not None:
            event = dataclasses.replace(
                held,
                t_wall=time.time(),
                num_requests=held.num_requests + num_more_requests,
                reason=reason or held.reason,
            )
        if event is not None:
            self._ended = True
            self._write(event)

    def _write(self, event: Event, line: bytes | None = None) -> None:
        if self._broken is not None:
            return
        try:
            self._writer.write(event, line)
        except OSError as exc:
            self._broken = f"cannot write the journal {self.path}: {exc.strerror or exc}"
            raise RunIncomplete(f"{self._broken}; the run stopped") from None
        self._display.handle(event)
        for listener in self._listeners:
            listener(event)

    def close(self) -> None:
        """Write the held `run_finished` (if `finish` was not called), then close."""
        try:
            self.finish()
        finally:
            try:
                self._writer.close()
            except OSError as exc:  # the final sync of a full disk
                if self._broken is None:
                    raise RunIncomplete(f"cannot write the journal {self.path}: {exc}") from None
