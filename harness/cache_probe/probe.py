"""The cross-tenant prefix-cache timing probe: sending the trials, assessing them.

The trials are `harness.cache_probe.design`'s (re-exported here: this module is the probe's
public API). They are sent one at a time, after a few unmeasured warm-up requests; only the
timed request's TTFT enters the statistics (`harness.cache_probe.stats`), with the cached tokens
the target reported for it and, where the engine exposes prefix-cache counters
(`harness.cache_probe.counters`), their increase over it (read just before and just after
the timed request); a trial whose seed request failed is dropped (its prefix may not be
cached).

Everything sent and seen can be journaled through `emit` (phase `cache_probe`, plans with
intent `control`, observations with their one-token text dropped, findings, and last a
`ProbeFinished` event with the verdict and statistics). This module knows nothing about how
an engine caches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcanary.canaries import CanaryMinter, Tokenizer
from kvcanary.canaries.redact import redact_quote
from kvcanary.harness.cache_probe.counters import CacheCounts, CounterSource
from kvcanary.harness.cache_probe.design import (
    DEFAULT_NUM_TRIALS,
    DEFAULT_PREFIX_FRACTION,
    DEFAULT_PROMPT_TOKENS,
    PHASE,
    Arm,
    Design,
    ProbeSettings,
    Send,
    Trial,
    design_trials,
    probe_tenants,
    settings_for,
    shares_credentials,
)
from kvcanary.harness.cache_probe.stats import (
    ArmKind,
    ArmPair,
    ArmSample,
    Assessment,
    assess,
    findings_of,
)
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    ProbeFinished,
)
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.tenant import Tenant, all_secrets

__all__ = [
    "DEFAULT_NUM_TRIALS",
    "DEFAULT_PREFIX_FRACTION",
    "DEFAULT_PROMPT_TOKENS",
    "PHASE",
    "CacheProbe",
    "CacheProbeResult",
    "Design",
    "ProbeSettings",
    "Send",
    "Trial",
    "TrialOutcome",
    "design_trials",
    "probe_tenants",
    "run_cache_probe",
    "settings_for",
    "shares_credentials",
]


@dataclass(frozen=True, slots=True)
class TrialOutcome:
    """What one trial measured."""

    trial: Trial
    ttft_ms: float | None
    """The timed request's TTFT; None when it or its seed failed."""
    cached_tokens: int | None
    error: str | None = None
    counted_hits: float | None = None
    """The engine's prefix-cache hit counter's increase over the timed request."""


@dataclass(frozen=True, slots=True)
class CacheProbeResult:
    """The probe's outcome: verdict, statistics, findings and every trial."""

    design: Design
    assessment: Assessment
    findings: tuple[Finding, ...]
    outcomes: tuple[TrialOutcome, ...] = field(repr=False)

    @property
    def verdict(self) -> Verdict:
        return self.assessment.verdict

    counters: str | None = None
    """The prefix-cache counter family read (`vllm:prefix_cache_hits`), or None."""
    stopped: bool = False
    """Stopped (Ctrl-C, SIGTERM) before its last trial was sent."""

    def to_details(self) -> dict[str, Any]:
        return {
            "assessment": self.assessment.to_details(),
            "design": self.design.to_record(),
            "counters": self.counters,
            "stopped": self.stopped,
        }


# -- running ---------------------------------------------------------------------------


class CacheProbe:
    """Sends a design's requests one at a time and assesses what it measured.

    `stop()` (a first Ctrl-C) sends no further trial once the one in flight is done;
    `cancel()` (a second) also cancels the request in flight. Either way the trials measured
    so far are assessed (too few, and the verdict is `unverifiable`).
    """

    def __init__(
        self,
        sender: TargetClient,
        design: Design,
        *,
        emit: Callable[[Event], None] | None = None,
        counters: CounterSource | None = None,
    ) -> None:
        """`emit` journals every plan, observation and finding as it happens; `counters`
        reads the engine's prefix-cache counters (not read again once they are missing)."""
        self.sender = sender
        self.design = design
        self._emit = emit
        self._counters = counters
        self._source: str | None = None
        self._stopping = False
        self._cancelled = False
        self._in_flight: asyncio.Future[Observation] | None = None
        sends = [*design.warmup, *(send for trial in design.trials for send in trial.sends)]
        self._secrets = all_secrets(send.tenant for send in sends)
        """Every probing tenant's credential: scrubbed from what the target sends back."""

    def stop(self) -> None:
        self._stopping = True

    def cancel(self) -> None:
        self._stopping = self._cancelled = True
        if self._in_flight is not None:
            self._in_flight.cancel()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def run(self) -> CacheProbeResult:
        self._event(PhaseStarted(PHASE, time.time()))
        first = await self._count()
        self._source = first.source if first is not None else None
        for send in self.design.warmup:
            if not self._stopping:
                await self._send(send)
        outcomes = []
        for trial in self.design.trials:
            if self._stopping:
                break
            outcomes.append(await self._trial(trial))
        result = self.assess(outcomes, stopped=len(outcomes) < len(self.design.trials))
        for finding in result.findings:
            self._event(FindingRecorded(finding, time.time()))
        self._event(ProbeFinished(PHASE, result.verdict, result.to_details(), time.time()))
        return result

    def assess(
        self, outcomes: Sequence[TrialOutcome], *, stopped: bool = False
    ) -> CacheProbeResult:
        """The statistics of `outcomes` (also usable on outcomes read back from a journal)."""
        settings = self.design.settings
        positive = ArmPair(
            "same_tenant",
            "*",
            "*",
            _sample(outcomes, "same_tenant"),
            _sample(outcomes, "miss"),
        )
        family = []
        cache_arms: tuple[ArmKind, ...] = ("cross_tenant", "spoofed_salt")
        for owner, prober in self.design.pairs:
            baseline = _sample(outcomes, "miss", owner, prober)
            for kind in cache_arms:
                candidate = _sample(outcomes, kind, owner, prober)
                if self.design.has_arm(kind, owner, prober):
                    family.append(ArmPair(kind, owner, prober, candidate, baseline))
        assessment = assess(
            positive,
            family,
            shared_tokens=_shared_pages(self.design),
            alpha=settings.alpha,
            trim_outliers=settings.trim_outliers,
        )
        findings = findings_of(assessment, self.design.to_record())
        return CacheProbeResult(
            self.design, assessment, tuple(findings), tuple(outcomes), self._source, stopped
        )

    async def _trial(self, trial: Trial) -> TrialOutcome:
        observations: list[Observation] = []
        before = after = None
        for send in trial.sends:
            if self._cancelled and observations:  # a second Ctrl-C sends nothing more
                break
            if send is trial.timed:
                before = await self._count()
            observations.append(await self._send(send))
        if before is not None:
            after = await self._count()
        failed = next((o for o in observations if not o.ok or o.ttft_ns is None), None)
        if failed is not None:
            why = failed.error or f"HTTP {failed.status} without a first token"
            return TrialOutcome(trial, None, None, f"{failed.request_id}: {why}")
        timed = observations[-1]
        assert timed.ttft_ns is not None
        counted = after.hits - before.hits if before is not None and after is not None else None
        return TrialOutcome(trial, timed.ttft_ns / 1e6, timed.usage.cached_tokens, None, counted)

    async def _count(self) -> CacheCounts | None:
        """The counters now; a target without them (or that stops serving them) is not
        asked again."""
        if self._counters is None or self._cancelled:
            return None
        counts = await self._counters.read()
        if counts is None:
            self._counters = None
        return counts

    async def _send(self, send: Send) -> Observation:
        if self.design.settings.pause_s:
            await asyncio.sleep(self.design.settings.pause_s)
        self._event(PlanRecorded(send.plan))
        t_sent_ns, t_wall = time.perf_counter_ns(), time.time()
        self._in_flight = asyncio.ensure_future(
            self.sender.send(send.plan, send.tenant, t_scheduled_ns=t_sent_ns, on_text=None)
        )
        try:
            obs = await self._in_flight
        except asyncio.CancelledError:
            if not (self._cancelled and self._in_flight.cancelled()):
                raise  # this task itself is being cancelled, not just the request
            obs = Observation(
                request_id=send.plan.request_id,
                tenant=send.plan.tenant,
                status=None,
                t_wall=t_wall,
                t_scheduled_ns=t_sent_ns,
                t_sent_ns=t_sent_ns,
                t_done_ns=time.perf_counter_ns(),
                error_kind="cancelled",
                error="cancelled by the user",
            )
        finally:
            self._in_flight = None
        # the text is one token of a reply to our own prompt; only its hash is kept, and of
        # an error only the harness's lead-in (the rest is the target's words)
        journaled = obs.without_secrets(self._secrets)
        error = redact_quote(journaled.error) if journaled.error else None
        journaled = dataclasses.replace(journaled, text="", text_redacted=True, error=error)
        self._event(ObservationRecorded(journaled))
        return journaled  # a trial's outcome quotes its error: the journaled one

    def _event(self, event: Event) -> None:
        if self._emit is not None:
            self._emit(event)


def _sample(
    outcomes: Sequence[TrialOutcome], arm: Arm, owner: str | None = None, prober: str | None = None
) -> ArmSample:
    chosen = [
        o
        for o in outcomes
        if o.trial.arm == arm
        and o.ttft_ms is not None
        and (owner is None or o.trial.owner == owner)
        and (prober is None or o.trial.prober == prober)
    ]
    counted = tuple(o.counted_hits for o in chosen)
    return ArmSample(
        tuple(o.ttft_ms for o in chosen if o.ttft_ms is not None),
        tuple(o.cached_tokens for o in chosen),
        counted if any(c is not None for c in counted) else (),
    )


def _shared_pages(design: Design) -> int:
    """Tokens a page-granular cache can serve to a timed request: its shared whole pages."""
    page = design.settings.page_size
    shared = [t.num_shared_tokens for t in design.trials if t.arm != "miss"]
    return min(shared, default=0) // page * page


async def run_cache_probe(
    sender: TargetClient,
    tenants: Sequence[Tenant],
    tokenizer: Tokenizer,
    settings: ProbeSettings | None = None,
    *,
    emit: Callable[[Event], None] | None = None,
    minter: CanaryMinter | None = None,
    counters: CounterSource | None = None,
) -> CacheProbeResult:
    """Design the trials for `tenants`, send them through `sender`, assess them."""
    design = design_trials(tenants, tokenizer, settings or ProbeSettings(), minter=minter)
    return await CacheProbe(sender, design, emit=emit, counters=counters).run()
