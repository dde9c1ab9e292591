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
`TargetServing` with how many failed meanwhile.

The target's own health route (`harness.target.health_route`), where it has one, is polled
alongside: `HEALTH_THRESHOLD` failed polls in a row make the same declaration (`source`
"health", `num_failed` the requests failed meanwhile, often 0: the route saw it first), and
a served request or a passing poll ends it. What was not tested after that point is the
report's business (verdict inconclusive); findings already made still stand.

It knows nothing about HTTP or the journal; the runner feeds it and emits what it returns.
"""

from __future__ import annotations

from kvcanary.harness.record.events import Event, TargetServing, TargetUnhealthy
from kvcanary.harness.record.observation import Observation

DEFAULT_THRESHOLD = 5
HEALTH_THRESHOLD = 2
"""Failed health polls in a row that declare the target unhealthy (one may be a blip)."""


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
        self._failed_polls: list[float] = []
        """When each health poll of the current run of failed polls was made."""

    def observe(self, obs: Observation, t_wall: float) -> list[Event]:
        """The health events `obs` causes (usually none)."""
        if _served(obs):
            events: list[Event] = []
            if self.unhealthy:
                events.append(TargetServing(t_wall=t_wall, num_failed=len(self._streak)))
            self.unhealthy = False
            self._streak.clear()
            self._failed_polls.clear()
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

    def observe_health(self, error: str | None, t_polled: float, t_wall: float) -> list[Event]:
        """The health events one poll of the target's health route causes: `error` is None
        when it passed. Polls before the target has served anything declare nothing (a
        target still starting is not a target that stopped)."""
        if error is None:
            events: list[Event] = []
            if self.unhealthy and self.declared is not None and self.declared.source == "health":
                events.append(TargetServing(t_wall=t_wall, num_failed=len(self._streak)))
                self.unhealthy = False
                self._streak.clear()
            self._failed_polls.clear()
            return events
        if self.num_served == 0:
            return []
        self._failed_polls.append(t_polled)
        if self.unhealthy or len(self._failed_polls) < HEALTH_THRESHOLD:
            return []
        self.unhealthy = True
        first = self._streak[0] if self._streak else None
        self.declared = TargetUnhealthy(
            t_wall=t_wall,
            since_t_wall=min([self._failed_polls[0], *(o.t_wall for o in self._streak[:1])]),
            num_failed=len(self._streak),
            num_served_before=self.num_served,
            first_request_id=first.request_id if first is not None else "",
            last_error=error,
            source="health",
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
