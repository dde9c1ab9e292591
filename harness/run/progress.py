"""What a person watching a run sees: live counters, findings as they appear, then a verdict.

On a terminal the display is a `rich` live line (phase, requests done of the budget or time
elapsed of the duration, in flight, rejections, errors, findings by kind) with each finding
printed above it as it is found. Anywhere else (CI logs, `nohup`, a pipe) it degrades to
plain lines: one per phase change, one per finding, and a status line every `interval_s`
(a soak also prints it as a `heartbeat:` line when nothing happened for that long).
Findings of one kind are shown `max_findings_shown` times, then counted, so a leaking target
does not flood a log.

It consumes journal events (`handle`) and knows nothing else about the run: no detectors, no
HTTP, no files. It never prints response text, only the finding's one-line summary.
"""

from __future__ import annotations

import time
from collections import Counter
from types import TracebackType
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    HealthRouteFailed,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    RunFinished,
    TargetServing,
    TargetUnhealthy,
)
from kvcanary.harness.run.options import format_duration

DEFAULT_INTERVAL_S = 10.0
MAX_FINDINGS_SHOWN = 5
OUTSIDE_BUDGET_PHASES = ("cache_probe",)
"""Phases whose requests are not the workload's: the opt-in cache probe
(`harness.cache_probe.design.PHASE`) sends its own trials after the workload, so they are
counted apart from `num_requests` ("4/4 requests | 95 cache-probe requests"), not against it."""


class ProgressDisplay:
    """Shows a run's progress from its events; use as a context manager around the run."""

    def __init__(
        self,
        *,
        num_requests: int | None = None,
        duration_s: float | None = None,
        file: IO[str] | None = None,
        live: bool | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_findings_shown: int = MAX_FINDINGS_SHOWN,
    ) -> None:
        self.console = Console(file=file, highlight=False, soft_wrap=True)
        self._live_enabled = self.console.is_terminal if live is None else live
        self._live: Live | None = None
        self.num_requests = num_requests
        self.duration_s = duration_s
        self.interval_s = interval_s
        self.max_findings_shown = max_findings_shown
        self.phase = "-"
        self.num_sent = 0
        self.num_done = 0
        self.num_probe_done = 0
        """Requests of `OUTSIDE_BUDGET_PHASES` answered (included in neither count above)."""
        self._probe_in_flight: set[str] = set()
        self.num_rejected = 0
        self.num_aborted = 0
        self.errors: Counter[str] = Counter()
        self.findings: Counter[str] = Counter()
        self._t_start = time.monotonic()
        self._t_last_line = self._t_start

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> ProgressDisplay:
        if self._live_enabled:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=True)
            self._live.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.note(self.status_line())

    # -- input --------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        """Take one journal event into account (called from the run's event loop)."""
        if isinstance(event, PlanRecorded):
            self.num_sent += 1
            if event.plan.phase in OUTSIDE_BUDGET_PHASES:
                self._probe_in_flight.add(event.plan.request_id)
        elif isinstance(event, ObservationRecorded):
            request_id = event.observation.request_id
            if request_id in self._probe_in_flight:
                self._probe_in_flight.discard(request_id)
                self.num_probe_done += 1
            else:
                self.num_done += 1
            kind = event.observation.error_kind
            if kind == "http_status":
                self.num_rejected += 1
            elif kind == "disconnected":  # an abort plan doing its job
                self.num_aborted += 1
            elif kind is not None:
                self.errors[kind] += 1
        elif isinstance(event, PhaseStarted):
            self.phase = event.phase
            self.note(f"phase {event.phase}")
        elif isinstance(event, FindingRecorded):
            self._finding(event)
        elif isinstance(event, TargetUnhealthy):
            why = f" (last: {event.last_error})" if event.last_error else ""
            if event.source == "health":
                what = (
                    f"{event.num_failed} requests in a row failed or timed out while its "
                    f"health route failed too{why}"
                )
            else:
                what = f"{event.num_failed} requests in a row failed"
                what += f" after {event.num_served_before} were answered{why}"
            self.note(f"the target stopped serving: {what}; what follows is untested")
        elif isinstance(event, HealthRouteFailed):
            self.note(
                f"the target's health route failed {event.num_polls} polls in a row "
                f"({event.last_error}) while {event.num_served_since} request(s) were answered: "
                "recorded; whether it serves is judged from its requests"
            )
        elif isinstance(event, TargetServing):
            self.note(f"the target answers again after {event.num_failed} failed request(s)")
        elif isinstance(event, RunFinished):
            return
        self._maybe_status_line()

    def heartbeat(self) -> None:
        """Off a terminal, the status line when none was printed for `interval_s`: a log
        that goes quiet then means the process is gone, not that the target is slow."""
        if self._live is not None:
            return
        now = time.monotonic()
        if now - self._t_last_line >= self.interval_s:
            self._t_last_line = now
            self.note(f"heartbeat: {self.status_line()}")

    def note(self, message: str) -> None:
        """A plain line, above the live display when there is one."""
        self.console.print(Text(f"[{self._elapsed()}] {message}"))

    # -- rendering ----------------------------------------------------------------------

    def status_line(self) -> str:
        """The one-line summary printed periodically off a terminal and at the end."""
        return " | ".join((*self._progress_parts(), self._findings_part()))

    def _progress_parts(self) -> list[str]:
        parts = [f"phase {self.phase}"]
        if self.num_requests is not None:
            parts.append(f"{self.num_done}/{self.num_requests} requests")
        else:
            parts.append(f"{self.num_done} requests")
            if self.duration_s is not None:
                parts.append(f"{self._elapsed()} of {format_duration(self.duration_s)}")
        if self.num_probe_done:
            parts.append(f"{self.num_probe_done} cache-probe requests")
        parts.append(f"{self.num_sent - self.num_done - self.num_probe_done} in flight")
        parts.append(f"{self.num_rejected} rejected")
        if self.num_aborted:
            parts.append(f"{self.num_aborted} aborted")
        num_errors = sum(self.errors.values())
        if num_errors:
            kinds = ", ".join(f"{k} {n}" for k, n in self.errors.most_common())
            parts.append(f"{num_errors} errors ({kinds})")
        return parts

    def _findings_part(self) -> str:
        num_findings = sum(self.findings.values())
        if not num_findings:
            return "no findings"
        kinds = ", ".join(f"{k} {n}" for k, n in self.findings.most_common())
        return f"{num_findings} findings ({kinds})"

    def __rich__(self) -> Group:
        style = "bold red" if self.findings else "green"
        return Group(
            Text.assemble(
                ("kvcanary ", "bold"), f"[{self._elapsed()}] ", " | ".join(self._progress_parts())
            ),
            Text(f"         {self._findings_part()}", style=style),
        )

    def _finding(self, event: FindingRecorded) -> None:
        kind = str(event.finding.kind)
        self.findings[kind] += 1
        count = self.findings[kind]
        if count <= self.max_findings_shown:
            self.note(f"FINDING {kind} ({event.finding.severity}): {event.finding.summary}")
            if count == self.max_findings_shown:
                self.note(f"further {kind} findings are counted, not shown (see the report)")

    def _maybe_status_line(self) -> None:
        if self._live is not None:
            return
        now = time.monotonic()
        if now - self._t_last_line >= self.interval_s:
            self._t_last_line = now
            self.note(self.status_line())

    def _elapsed(self) -> str:
        seconds = int(time.monotonic() - self._t_start)
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
