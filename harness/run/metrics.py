"""Prometheus metrics of a running soak (`--metrics-port`): how it is doing, from outside.

`RunMetrics` consumes journal events, as the progress display does, and keeps counters in
its own registry (never the process-global one, so two runs in one process do not mix):

    kvcanary_requests_total{intent}       plans sent (journaled before sending)
    kvcanary_responses_total{outcome}     observations: ok, rejected (HTTP status), or the
                                          error kind (timeout, disconnected, ...)
    kvcanary_errors_total{kind}           observations with an error, by kind (rejections
                                          included, as `http_status`)
    kvcanary_findings_total{kind}         findings by kind
    kvcanary_ttft_seconds{intent}         histogram of time to first token
    kvcanary_target_healthy               1 while the target serves, 0 once declared unhealthy
    kvcanary_last_event_timestamp_seconds wall time of the latest event (a stall shows here)

`serve_metrics` serves them on 127.0.0.1:PORT/metrics from a daemon thread for the run's
life. The counts are the journal's: a scrape and the journal agree on every counter. It
needs the optional `prometheus-client` (`kvcanary[metrics]`), imported only when asked for.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    ObservationRecorded,
    PlanRecorded,
    TargetServing,
    TargetUnhealthy,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""From a cached short prompt (milliseconds) to a 1M-token prefill (a minute or more)."""


class RunMetrics:
    """Counters of one run, fed its journal events (`handle`)."""

    def __init__(self) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError:
            raise ConfigError(
                "--metrics-port needs prometheus-client: pip install 'kvcanary[metrics]'"
            ) from None
        self.registry: CollectorRegistry = CollectorRegistry()
        registry = self.registry
        self._requests = Counter(
            "kvcanary_requests", "Requests sent, by intent.", ["intent"], registry=registry
        )
        self._responses = Counter(
            "kvcanary_responses", "Requests finished, by outcome.", ["outcome"], registry=registry
        )
        self._errors = Counter(
            "kvcanary_errors", "Requests that failed, by error kind.", ["kind"], registry=registry
        )
        self._findings = Counter(
            "kvcanary_findings", "Findings, by kind.", ["kind"], registry=registry
        )
        self._ttft = Histogram(
            "kvcanary_ttft_seconds",
            "Time to first token, by intent.",
            ["intent"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self._healthy = Gauge(
            "kvcanary_target_healthy", "1 while the target serves, 0 when not.", registry=registry
        )
        self._healthy.set(1)
        self._last_event = Gauge(
            "kvcanary_last_event_timestamp_seconds",
            "Wall time of the run's latest event.",
            registry=registry,
        )
        self._intents: dict[str, str] = {}
        """Intent of each request in flight (an observation does not carry it)."""

    def handle(self, event: Event) -> None:
        """Count one journal event."""
        self._last_event.set(time.time())
        if isinstance(event, PlanRecorded):
            self._intents[event.plan.request_id] = event.plan.intent
            self._requests.labels(event.plan.intent).inc()
        elif isinstance(event, ObservationRecorded):
            obs = event.observation
            intent = self._intents.pop(obs.request_id, "unknown")
            kind = obs.error_kind
            self._responses.labels("ok" if kind is None else str(kind)).inc()
            if kind is not None:
                self._errors.labels(str(kind)).inc()
            ttft_ns = obs.ttft_ns
            if ttft_ns is not None:
                self._ttft.labels(intent).observe(ttft_ns / 1e9)
        elif isinstance(event, FindingRecorded):
            self._findings.labels(str(event.finding.kind)).inc()
        elif isinstance(event, TargetUnhealthy):
            self._healthy.set(0)
        elif isinstance(event, TargetServing):
            self._healthy.set(1)


@contextlib.contextmanager
def serve_metrics(port: int) -> Iterator[RunMetrics]:
    """`RunMetrics` served on 127.0.0.1:`port`/metrics until the block ends."""
    from prometheus_client import start_http_server

    metrics = RunMetrics()
    try:
        server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot listen ({exc.strerror})") from None
    try:
        yield metrics
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
