"""What resuming a soak needs from its journal, and the checkpoint that saves reading it all.

`ResumeState` folds journal events into what a resumed session continues from: the run's
first `run_started`, how many plans were journaled, the next request number, and the run
time of the sessions so far (each `run_started` opens a session; a session lasts from it to
the latest `t_wall` after it). Folding a whole journal is minutes after a night's soak, so a
soak saves the state at every rotation (`save_checkpoint`: `journal.checkpoint.json`, the
state through the last closed segment, written atomically), folding the events it journals
as it goes; `load` then reads the checkpoint and only the segments after it. A checkpoint
that is missing, unreadable, or names a segment that is not there is ignored: the journal
is read whole, as without one.

It reads journals and writes only the checkpoint; it knows nothing about targets.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcanary.harness.record.events import (
    Event,
    ObservationRecorded,
    PlanRecorded,
    RunStarted,
    from_record,
    to_record,
)
from kvcanary.harness.record.journal import (
    JournalWarning,
    closed_segments,
    journal_segments,
    read_journal,
)

CHECKPOINT_NAME = "journal.checkpoint.json"
_VERSION = 1
_NUMBER = re.compile(r"(\d+)$")


@dataclass(slots=True)
class ResumeState:
    """The fold of a journal's events that a resumed soak continues from."""

    started: RunStarted | None = None
    num_plans: int = 0
    next_request: int = 0
    closed_s: float = 0.0
    """Run time of the sessions before the current one."""
    session: list[float] = field(default_factory=list)
    """The current session's first and latest wall times."""

    def feed(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.started = self.started or event
            self.closed_s += self.session[-1] - self.session[0] if self.session else 0.0
            self.session = [event.t_wall]
            return
        t_wall = _t_wall(event)
        if t_wall is not None and self.session:
            self.session[1:] = [max(t_wall, self.session[-1])]
        if isinstance(event, PlanRecorded):
            self.num_plans += 1
            number = _NUMBER.search(event.plan.request_id)
            if number is not None:
                self.next_request = max(self.next_request, int(number.group(1)) + 1)

    @property
    def elapsed_s(self) -> float:
        """Run time of every session so far, the current one included."""
        return self.closed_s + (self.session[-1] - self.session[0] if self.session else 0.0)

    def to_dict(self) -> dict[str, Any]:
        started = None if self.started is None else to_record(self.started)
        return {
            "started": started,
            "num_plans": self.num_plans,
            "next_request": self.next_request,
            "closed_s": self.closed_s,
            "session": list(self.session),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResumeState:
        started = data["started"]
        event = None if started is None else from_record(started)
        if event is not None and not isinstance(event, RunStarted):
            raise ValueError("not a run_started record")
        session = [float(t) for t in data["session"]]
        if len(session) > 2:
            raise ValueError("a session has two times at most")
        state = cls(event, int(data["num_plans"]), int(data["next_request"]))
        state.closed_s, state.session = float(data["closed_s"]), session
        return state

    @classmethod
    def load(cls, run_dir: Path) -> ResumeState:
        """The state of the journal in `run_dir`: from its checkpoint and the segments after
        it where the checkpoint is usable, else from every segment."""
        state, after = cls(), 0
        if not journal_segments(run_dir):
            return state  # nothing journaled yet
        checkpoint = _read_checkpoint(run_dir)
        if checkpoint is not None:
            state, after = checkpoint
        with warnings.catch_warnings():
            # a torn last line is what a killed soak leaves behind: expected here
            warnings.simplefilter("ignore", JournalWarning)
            for event in read_journal(run_dir, after=after):
                state.feed(event)
        return state


def save_checkpoint(run_dir: Path, segment: int, state: ResumeState) -> Path:
    """Write `state` as the fold of the journal through closed segment `segment`."""
    path = run_dir / CHECKPOINT_NAME
    partial = path.with_name(path.name + ".partial")
    data = json.dumps({"version": _VERSION, "segment": segment, "state": state.to_dict()})
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, path)
    return path


def _read_checkpoint(run_dir: Path) -> tuple[ResumeState, int] | None:
    try:
        data = json.loads((run_dir / CHECKPOINT_NAME).read_text())
        segment = int(data["segment"])
        state = ResumeState.from_dict(data["state"])
        if data.get("version") != _VERSION:
            return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    numbers = [number for number, _ in closed_segments(run_dir)]
    if segment not in numbers:  # a checkpoint of another journal, or ahead of this one
        return None
    return state, segment


def _t_wall(event: object) -> float | None:
    if isinstance(event, ObservationRecorded):
        return event.observation.t_wall
    value = getattr(event, "t_wall", None)
    return float(value) if isinstance(value, int | float) else None
