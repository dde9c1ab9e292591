"""What follows a request's response, wherever its content was scanned (in the runner, or
in the Ray actor that sent it: `--ray`): the timing and protocol detectors, the observation
and the findings journaled, the target's health.

In this order (`Settler.settle`): the timing detector observes the answer; the protocol
detector weighs it with the content and timing findings on it; the observation is journaled
(its text redacted to the canary spans and the target's words in its error to a marker,
`journaled_form`, unless raw evidence was asked for), then the request's own echo, then the
findings (but a high `unsafe_accept` whose answer the timing detector judges only at the end
of the run, which `finish` journals after that final pass, made critical by a
`fast_prefill` it finds); then `target_unhealthy` / `target_serving` when the target
stopped / resumed serving (`harness.run.health`); then the timing model, whenever it
changed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from kvcanary.canaries import Hit, redact
from kvcanary.canaries.redact import redact_quote
from kvcanary.harness.detectors.protocol import with_late_evidence
from kvcanary.harness.detectors.timing import DefersJudgement
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    ObservationRecorded,
    OwnEchoRecorded,
    TimingFitted,
)
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.harness.run.health import HealthTracker
from kvcanary.harness.run.seams import Detectors
from kvcanary.tenants.plan import RequestPlan

Emit = Callable[[Event, bytes | None], None]
"""Journals an event (the bytes: its line, where it was encoded already)."""


def journaled_form(
    obs: Observation, hits: Sequence[Hit], secrets: Sequence[str], *, keep_raw_evidence: bool
) -> tuple[Observation, Observation]:
    """`obs` as the journal keeps it, and as reports and the console show it: every
    credential scrubbed (whatever the target echoed back), the text redacted to the canary
    spans `hits` and the error quoted as a marker, unless `keep_raw_evidence`."""
    obs = obs.without_secrets(secrets)
    if obs.text and not keep_raw_evidence:
        obs = dataclasses.replace(obs, text=redact(obs.text, hits), text_redacted=True)
    # an error body is the target's text too; what reports and the console show of it
    # (`target_unhealthy`) is redacted even when the journal keeps it raw
    shown = shown_form(obs)
    return (obs if keep_raw_evidence else shown), shown


def shown_form(obs: Observation) -> Observation:
    """`obs` with the target's words in its error redacted to a marker."""
    return dataclasses.replace(obs, error=redact_quote(obs.error)) if obs.error else obs


class Settler:
    """Judges and journals each finished request; `finish` at the end of the run."""

    def __init__(self, detectors: Detectors, emit: Emit) -> None:
        self._detectors = detectors
        self._emit = emit
        self.health = HealthTracker()
        self._journaled_model: TtftModel | None = None
        self._held: list[Finding] = []
        """High `unsafe_accept`s held for the end-of-run timing judgement."""

    def settle(
        self,
        plan: RequestPlan,
        obs: Observation,
        shown: Observation,
        *,
        streamed: Sequence[Finding] = (),
        content: Sequence[Finding] = (),
        echo: OwnEchoRecorded | None = None,
        line: bytes | None = None,
    ) -> None:
        """`obs` (as journaled; `shown`: as shown) of `plan`, after its content scan found
        `streamed` findings while it streamed (journaled already) and `content` at its end."""
        detectors = self._detectors
        timing = detectors.timing.observe(plan, obs)
        evidence = [*streamed, *content, *timing]
        findings = [*content, *detectors.protocol.check(plan, obs, evidence), *timing]
        self._emit(ObservationRecorded(obs), line)
        if echo is not None:
            self._emit(echo, None)
        for finding in findings:
            if self._judged_at_the_end(finding):
                self._held.append(finding)
            else:
                self.emit_finding(finding)
        for event in self.health.observe(shown, time.time()):
            self._emit(event, None)
        self.record_timing_model()

    def finish(self, *, judge: bool) -> None:
        """The end of the run: with `judge`, the timing detector's final pass and its model;
        then the held `unsafe_accept`s, made critical by a `fast_prefill` found now."""
        late: list[Finding] = []
        if judge:
            late = self._detectors.timing.finish()
            for finding in late:
                self.emit_finding(finding)
            self.record_timing_model(final=True)
        for finding in self._held:
            self.emit_finding(with_late_evidence(finding, late))
        self._held.clear()

    def emit_finding(self, finding: Finding) -> None:
        self._emit(FindingRecorded(finding, t_wall=time.time()), None)

    def _judged_at_the_end(self, finding: Finding) -> bool:
        """A high `unsafe_accept` whose answer the timing detector judges only at the end
        (its fit was too small online): held until then, so a `fast_prefill` found at the
        end makes it critical (`harness.detectors.protocol.with_late_evidence`)."""
        timing = self._detectors.timing
        return (
            finding.kind == FindingKind.UNSAFE_ACCEPT
            and finding.severity == Severity.HIGH
            and finding.request_id is not None
            and isinstance(timing, DefersJudgement)
            and timing.is_deferred(finding.request_id)
        )

    def record_timing_model(self, *, final: bool = False) -> None:
        """Journal the timing detector's model whenever it changes (it refits at a growing
        sample count, so a long run writes O(log n) of these), and once more at the end."""
        timing = self._detectors.timing
        model = timing.model
        if model is self._journaled_model and not final:
            return
        self._journaled_model = model
        fitted = model.to_dict() if model is not None else None
        not_judged = timing.not_judged if final else None
        self._emit(
            TimingFitted(fitted, t_wall=time.time(), final=final, not_judged=not_judged), None
        )
