"""The prefix-cache probe as a run's phase: trials designed for the run's tenants, sent
through the run's client, judged, journaled. `kvcanary run --cache-probe` runs it after the
workload, before the run's `run_finished`; a scenario's `cache_probe` step runs it between
other steps."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from kvcanary.canaries import Tokenizer
from kvcanary.harness.cache_probe.counters import CounterSource
from kvcanary.harness.cache_probe.probe import (
    CacheProbe,
    CacheProbeResult,
    ProbeSettings,
    design_trials,
    probe_tenants,
    shares_credentials,
)
from kvcanary.harness.record.events import Event
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.tenant import Tenant


async def run_probe_phase(
    client: TargetClient,
    tenants: Sequence[Tenant],
    tokenizer: Tokenizer,
    settings: ProbeSettings,
    *,
    salts: bool,
    emit: Callable[[Event], None],
    display: ProgressDisplay,
    counters: CounterSource | None = None,
    wrap: Callable[[Any], contextlib.AbstractContextManager[None]] | None = None,
) -> tuple[CacheProbeResult, int]:
    """The prefix-cache probe: trials designed, sent and judged; findings journaled.

    Returns the result and how many requests it sent. `counters` reads the engine's
    prefix-cache counters (`harness.cache_probe.counters`); `wrap(probe)` surrounds the
    sending (the session's Ctrl-C handling). Raises `ConfigError` for a design the limits
    cannot hold.
    """
    salted = probe_tenants(list(tenants), salts=salts)
    if shares_credentials(salted):  # what the probe really sends, anonymous tokens included
        display.note(
            "cache probe: the tenants share one credential, so a cache keyed by credential "
            "cannot tell them apart; give each tenant its own key to test that"
        )
    design = await asyncio.to_thread(design_trials, salted, tokenizer, settings)
    display.note(
        f"cache probe: {design.num_requests} requests, {len(design.pairs)} tenant pairs, "
        f"{settings.num_trials} trials per arm, {settings.num_prefix_tokens}-token shared "
        f"prefix of {settings.num_prompt_tokens}"
    )
    probe = CacheProbe(client, design, emit=emit, counters=counters)
    with wrap(probe) if wrap is not None else contextlib.nullcontext():
        result = await probe.run()
    if result.counters is not None:
        counted = result.assessment.positive_control.counted
        display.note(
            f"cache probe: prefix-cache counters ({result.counters}): "
            f"{counted.num_reported_hits}/{counted.num_reporting} of the positive control's "
            f"trials counted as hits beyond the miss arm's (median {counted.control_median} "
            "tokens)"
        )
    verdict = str(result.verdict).upper()
    display.note(f"cache probe: {verdict}: {'; '.join(result.assessment.reasons)}")
    return result, design.num_requests
