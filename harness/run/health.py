"""Target health: noticing that a target stopped serving in the middle of a run.

A target whose worker died (transformers serve answered every request after an over-long
prompt with `503 CB worker is dead`) otherwise looks like a run with a few findings: every
later request just fails. `HealthTracker` watches the observations in the order they finish:

    served   any HTTP status below 500 (a 4xx rejection is the target doing its job)
    failed   a 5xx, or a connection-level failure with no status (`connect`, or `protocol`
             with no response head: the server closed the connection on the request)
    neutral  everything else: timeouts (a long prefill is not a dead target), aborts the
             harness made on purpose, cancellations

After at least one served request, `threshold` failed requests in a row make a
`TargetUnhealthy` event (once per run of failures); the next served request makes a
`TargetServing` with how many failed meanwhile. What was not tested after that point is the
report's business (verdict inconclusive); findings already made still stand.

It knows nothing about HTTP or the journal; the runner feeds it and emits what it returns.
"""

from __future__ import annotations

from harness.record.events import Event, TargetServing, TargetUnhealthy
from harness.record.observation import Observation

DEFAULT_THRESHOLD = 5


class HealthTracker:
    """Counts failures in a row after the target has served; says when it stopped, and
    when it came back."""

    def __init__(self, threshold: int = DEFAULT_THRESHOLD) -> None:
        assert threshold >= 1, threshold
        self.threshold = threshold
        self.num_served = 0
        self.unhealthy = False
        """Whether the target is declared unhealthy now."""
        self.declared: TargetUnhealthy | None = None
        """The last declaration made, if any."""
        self._streak: list[Observation] = []

    def observe(self, obs: Observation, t_wall: float) -> list[Event]:
        """The health events `obs` causes (usually none)."""
        if _served(obs):
            events: list[Event] = []
            if self.unhealthy:
                events.append(TargetServing(t_wall=t_wall, num_failed=len(self._streak)))
            self.unhealthy = False
            self._streak.clear()
            self.num_served += 1
            return events
        if not _failed(obs) or self.num_served == 0:
            return []
        self._streak.append(obs)
        if self.unhealthy or len(self._streak) < self.threshold:
            return []
        self.unhealthy = True
        first = min(self._streak, key=lambda o: o.t_wall)
        self.declared = TargetUnhealthy(
            t_wall=t_wall,
            since_t_wall=first.t_wall,
            num_failed=len(self._streak),
            num_served_before=self.num_served,
            first_request_id=first.request_id,
            last_error=obs.error,
        )
        return [self.declared]


def _served(obs: Observation) -> bool:
    return obs.status is not None and obs.status < 500


def _failed(obs: Observation) -> bool:
    if obs.status is not None:
        return obs.status >= 500
    return obs.error_kind == "connect" or (
        obs.error_kind == "protocol" and obs.t_first_byte_ns is None
    )
