"""Target health: noticing, from its requests, that a target stopped serving mid-run.

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
alongside, but it is a witness, not a judge: llama.cpp's `/health` does not answer while its
slots compute, and a single-process server under load answers it late, while every request
is answered. `HEALTH_THRESHOLD` failed polls in a row are recorded once (`HealthRouteFailed`,
with the requests served meanwhile) and never declare anything by themselves. While its
last poll failed, a request that times out counts as failed (source `health`): two
witnesses agree that requests stopped completing. A passing poll ends that.

It knows nothing about HTTP or the journal; the runner feeds it and emits what it returns.
"""

from __future__ import annotations

from kvcanary.harness.record.events import (
    Event,
    HealthRouteFailed,
    TargetServing,
    TargetUnhealthy,
)
from kvcanary.harness.record.observation import Observation

DEFAULT_THRESHOLD = 5
HEALTH_THRESHOLD = 2
"""Failed health polls in a row that are recorded as the route failing (one may be a blip)."""


class HealthTracker:
    """Counts failed requests in a row after the target has served; says when it stopped,
    and when it came back. Records when its health route fails, without judging by it."""

    def __init__(self, threshold: int = DEFAULT_THRESHOLD) -> None:
        assert threshold >= 1, threshold
        self.threshold = threshold
        self.num_served = 0
        self.unhealthy = False
        """Whether the target is declared unhealthy now."""
        self.declared: TargetUnhealthy | None = None
        """The last declaration made, if any."""
        self.route_failing = False
        """Whether the health route has failed `HEALTH_THRESHOLD` polls in a row, and not
        passed one since."""
        self._num_failed = 0
        """Failed requests in a row (the current streak): counted, not kept, so a soak
        against a dead target holds no more than its first."""
        self._first_failed: Observation | None = None
        """The streak's earliest failed request (requests finish out of order)."""
        self._timeouts_counted = False
        """Whether the current streak counts a timeout because the route was failing."""
        self._failed_polls: list[float] = []
        """When each health poll of the current run of failed polls was made."""
        self._num_served_at_first_failed_poll = 0

    def observe(self, obs: Observation, t_wall: float) -> list[Event]:
        """The health events `obs` causes (usually none)."""
        if _served(obs):
            events: list[Event] = []
            if self.unhealthy:
                events.append(TargetServing(t_wall=t_wall, num_failed=self._num_failed))
            self.unhealthy = False
            self._num_failed, self._first_failed = 0, None
            self._timeouts_counted = False
            self.num_served += 1
            return events
        stalled = bool(self._failed_polls) and obs.error_kind == "timeout"
        if not (_failed(obs) or stalled) or self.num_served == 0:
            return []
        self._num_failed += 1
        if self._first_failed is None or obs.t_wall < self._first_failed.t_wall:
            self._first_failed = obs
        self._timeouts_counted = self._timeouts_counted or stalled
        if self.unhealthy or self._num_failed < self.threshold:
            return []
        self.unhealthy = True
        first = self._first_failed
        self.declared = TargetUnhealthy(
            t_wall=t_wall,
            since_t_wall=first.t_wall,
            num_failed=self._num_failed,
            num_served_before=self.num_served,
            first_request_id=first.request_id,
            last_error=obs.error,
            source="health" if self._timeouts_counted else "requests",
        )
        return [self.declared]

    def observe_health(self, error: str | None, t_polled: float, t_wall: float) -> list[Event]:
        """What one poll of the target's health route causes (`error` is None when it
        passed): a `HealthRouteFailed` record once per run of failed polls, nothing else.
        Polls before the target has served anything say nothing (it may still be starting)."""
        if error is None:
            self._failed_polls.clear()
            self.route_failing = False
            return []
        if self.num_served == 0:
            return []
        if not self._failed_polls:
            self._num_served_at_first_failed_poll = self.num_served
        self._failed_polls.append(t_polled)
        if self.route_failing or len(self._failed_polls) < HEALTH_THRESHOLD:
            return []
        self.route_failing = True
        return [
            HealthRouteFailed(
                t_wall=t_wall,
                since_t_wall=self._failed_polls[0],
                num_polls=len(self._failed_polls),
                last_error=error,
                num_served_since=self.num_served - self._num_served_at_first_failed_poll,
            )
        ]


def _served(obs: Observation) -> bool:
    return obs.status is not None and obs.status < 500


def _failed(obs: Observation) -> bool:
    if obs.status is not None:
        return obs.status >= 500
    return obs.error_kind == "connect" or (
        obs.error_kind == "protocol" and obs.t_first_byte_ns is None
    )
