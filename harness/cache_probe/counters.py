"""The engine's own prefix-cache counters: the probe's second witness beside `cached_tokens`.

Where the target's Prometheus page (`GET /metrics`) counts the prompt tokens its prefix
cache served, the probe reads the count before and after each timed request; the difference
is how many of that request's tokens the engine says it served from cache. Known families,
first found wins:

    vLLM     vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total
             (older: vllm:gpu_prefix_cache_hits_total / ..._queries_total)
    SGLang   sglang:cached_tokens_total / sglang:prompt_tokens_total

Samples of one family are summed over their labels (engines, data-parallel ranks). A
disaggregated SGLang deployment exposes the same count on its decode side (the tokens prefill
served, reported again), so decode's samples count only where nothing else reports.

Like `cached_tokens`, a count is evidence only by how much it exceeds the miss arm's
(`harness.cache_probe.stats`): other traffic on a shared deployment lands in every arm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx

from kvcanary.harness.target.discovery_fetch import Fetcher

COUNTER_FAMILIES = (
    ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
    ("sglang:cached_tokens", "sglang:prompt_tokens"),
)
"""(hits, queries) counter families, without the `_total` suffix, in the order tried."""
READ_TIMEOUT_S = 5.0
"""One scrape; a metrics page slower than this is read as no counters."""


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """One reading of the engine's prefix-cache counters (tokens, since it started)."""

    hits: float
    queries: float | None
    source: str
    """The hits family read (`vllm:prefix_cache_hits`)."""


class CounterSource(Protocol):
    """Reads the target's prefix-cache counters now; None where it has none."""

    async def read(self) -> CacheCounts | None: ...


def parse_counts(text: str) -> CacheCounts | None:
    """The first known family in Prometheus text `text`; None when none is there (or it is
    not Prometheus text at all)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, dict[bool, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                decode = sample.labels.get("disaggregation_mode") == "decode"
                by_side = totals.setdefault(sample.name.removesuffix("_total"), {})
                by_side[decode] = by_side.get(decode, 0.0) + float(sample.value)
    except ValueError:
        return None  # an HTML page, a proxy's error body
    for hits, queries in COUNTER_FAMILIES:
        if hits in totals:
            return CacheCounts(_total(totals[hits]), _total(totals.get(queries)), hits)
    return None


def _total(by_side: Mapping[bool, float] | None) -> float:
    """Every side but decode; decode's own count where it is the only one."""
    if not by_side:
        return 0.0
    return by_side.get(False, by_side.get(True, 0.0))


class MetricsCounters:
    """A `CounterSource` over the target's `/metrics` (bounded in time and size)."""

    def __init__(
        self, http: httpx.AsyncClient, base_url: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self._fetcher = Fetcher(http, base_url, headers, timeout_s=READ_TIMEOUT_S)

    async def read(self) -> CacheCounts | None:
        fetched = await self._fetcher.get("/metrics")
        self._fetcher.attempts.clear()  # read twice per trial: keep no history
        if fetched is None or fetched.status != 200:
            return None
        return parse_counts(fetched.body.decode("utf-8", errors="replace"))
