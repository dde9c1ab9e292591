"""Prometheus metrics with SGLang's names, one registry per app.

Each side app owns a `SideMetrics`: what the HTTP layer observes itself (time to first
token, end-to-end latency, prompt/generation/cached tokens from each `FinishOut`, requests
by status, client-disconnect aborts) plus, at scrape time, every value of the side's
`metrics_snapshot()` (token usage, running and queued requests, transfer and bootstrap
failures, ...), named `sglang:<key>` (a key ending in `_total` is a counter). Where both
count the same thing (prompt and generation tokens) the HTTP layer's family is the one
exposed, so a name appears once. Every sample carries `model_name` and
`disaggregation_mode` labels.

The router owns a `RouterMetrics` and answers `/metrics` with its own families followed by
the sides' families merged per name (`merge_expositions`), the way one scrape of a PD
deployment sees both servers. Registries are never the global default one, so any number
of apps can live in one process (tests, the in-process engine).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvcanary.reference_engine.interfaces import FinishOut

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_LABELS = ("model_name", "disaggregation_mode")
_HTTP_OWNED = frozenset(
    {"prompt_tokens", "generation_tokens", "cached_tokens", "num_requests", "num_aborted_requests"}
)
_ENGINE_HELP = {
    "token_usage": "Fraction of the KV pool's tokens owned by requests",
    "num_used_tokens": "KV-pool tokens owned by requests",
    "num_running_reqs": "Requests running (prefill forward or decode batch)",
    "num_queue_reqs": "Requests waiting in queues",
    "num_transfer_failed_reqs": "Requests whose KV transfer failed",
    "num_bootstrap_failed_reqs": "Requests whose bootstrap failed",
}


def _metric_name(key: str) -> str:
    return "sglang:" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _EngineCollector(Collector):
    """The side's `metrics_snapshot()`, read at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, float]], labels: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        for key, value in sorted(self._snapshot().items()):
            base = key.removesuffix("_total")
            if base in _HTTP_OWNED:
                continue
            help_text = _ENGINE_HELP.get(base, f"Engine value {key!r}")
            family: Metric
            if key.endswith("_total"):
                family = CounterMetricFamily(_metric_name(base), help_text, labels=names)
            else:
                family = GaugeMetricFamily(_metric_name(key), help_text, labels=names)
            family.add_metric(values, float(value))
            yield family


class SideMetrics:
    """One side app's registry."""

    def __init__(
        self, mode: str, model_name: str, snapshot: Callable[[], dict[str, float]]
    ) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "disaggregation_mode": mode}
        reg = self.registry
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token, seen by this server",
            _LABELS, registry=reg, buckets=_LATENCY_BUCKETS,
        ).labels(**self._labels)  # fmt: skip
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds", "Request latency, seen by this server",
            _LABELS, registry=reg, buckets=_LATENCY_BUCKETS,
        ).labels(**self._labels)  # fmt: skip
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens reported in usage")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens")
        self.cached_tokens = self._counter("cached_tokens", "Prompt tokens served from cache")
        self.aborted = self._counter("num_aborted_requests", "Requests aborted by a disconnect")
        self._requests = Counter(
            "sglang:num_requests", "Finished requests by HTTP status", (*_LABELS, "code"),
            registry=reg,
        )  # fmt: skip
        reg.register(_EngineCollector(snapshot, self._labels))

    def _counter(self, name: str, help_text: str) -> Any:
        counter = Counter(f"sglang:{name}", help_text, _LABELS, registry=self.registry)
        return counter.labels(**self._labels)

    def observe_finish(self, finish: FinishOut, latency_s: float) -> None:
        self.prompt_tokens.inc(finish.prompt_tokens)
        self.generation_tokens.inc(finish.completion_tokens)
        self.cached_tokens.inc(finish.cached_tokens)
        self._requests.labels(**self._labels, code=str(finish.status)).inc()
        self.e2e.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RouterMetrics:
    """The router's own registry: requests by decode's status, TTFT as the client sees it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sglang:router_requests", "Requests answered, by the status returned",
            ("code",), registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "sglang:router_time_to_first_token_seconds",
            "Time from a request's arrival to decode's first response byte",
            registry=self.registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip

    def render(self, side_texts: Iterable[str]) -> bytes:
        return generate_latest(self.registry) + merge_expositions(side_texts)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: Iterable[str]) -> bytes:
    """Several servers' text expositions as one: samples of a same-named family merged."""
    merged: dict[tuple[str, str], Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            key = (family.name, family.type)
            if key not in merged:
                merged[key] = Metric(family.name, family.documentation, family.type)
            merged[key].samples.extend(family.samples)
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
