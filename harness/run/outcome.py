"""How a run ended and what it saw, counted from its events as they are journaled."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    ObservationRecorded,
    PlanRecorded,
    TargetUnhealthy,
)


@dataclass(slots=True)
class RunOutcome:
    """How a run ended and what it saw (the report has the full story)."""

    reason: str
    num_requests: int
    num_observations: int
    errors: Counter[str] = field(default_factory=Counter)
    """Observations by `error_kind` (rejections are `http_status`)."""
    findings: Counter[str] = field(default_factory=Counter)
    target_unhealthy: TargetUnhealthy | None = None
    """Set when the target stopped serving during the run (`harness.run.health`)."""

    def count(self, event: Event) -> None:
        """Count one event the run journals."""
        if isinstance(event, PlanRecorded):
            self.num_requests += 1
        elif isinstance(event, ObservationRecorded):
            self.num_observations += 1
            if event.observation.error_kind is not None:
                self.errors[event.observation.error_kind] += 1
        elif isinstance(event, FindingRecorded):
            self.findings[str(event.finding.kind)] += 1
        elif isinstance(event, TargetUnhealthy):
            self.target_unhealthy = event
