"""The finding vocabulary shared by detectors, the journal, reports and the pytest plugin.

A finding is one reason to believe a target is unsafe. Its kind is drawn from the fixed
vocabulary below, each kind with its severity, verdict and meaning in one table
(`KIND_RULES`); everything a human needs to act on it travels with it. Excerpts of
responses are redacted by the detector that creates the finding, never later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvcanary.harness.record.verdict import Verdict


class FindingKind(StrEnum):
    """What kind of unsafe behaviour a finding reports (its rule: `KIND_RULES`)."""

    CROSS_TENANT_CANARY = "cross_tenant_canary"
    CROSS_REQUEST_CANARY = "cross_request_canary"
    UNKNOWN_CANARY = "unknown_canary"
    UNSAFE_ACCEPT = "unsafe_accept"
    FAST_PREFILL = "fast_prefill"
    PROMPT_TOKENS_MISMATCH = "prompt_tokens_mismatch"
    SHARED_PREFIX_CACHE = "shared_prefix_cache"
    POOL_SMALLER_THAN_CONTEXT = "pool_smaller_than_context"
    ERROR_IN_SUCCESS = "error_in_success"
    CACHE_SALT_NOT_BOUND = "cache_salt_not_bound"
    """A tenant sending another tenant's `cache_salt` is served from that tenant's cache: the
    salt is a bearer secret, not bound to the credential; anyone who learns it reads the cache."""

    @property
    def rule(self) -> KindRule:
        return KIND_RULES[self]

    @property
    def severity(self) -> Severity:
        """The one severity of this kind, wherever a detector or the audit reports it."""
        return KIND_RULES[self].severity

    @property
    def verdict(self) -> Verdict:
        """The verdict a finding of this kind gives on its own (`KindRule.leak_with` can
        raise it to `leak`)."""
        return KIND_RULES[self].verdict

    @property
    def meaning(self) -> str:
        """What a finding of this kind means, in one phrase."""
        return KIND_RULES[self].meaning

    @property
    def leak(self) -> str | None:
        """What a finding of this kind says about a leak (its origin), or None for the kinds
        that show unsafe behaviour rather than leaked data."""
        return KIND_RULES[self].origin


class Severity(StrEnum):
    """How urgently a human should look."""

    CRITICAL = "critical"
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


@dataclass(frozen=True, slots=True)
class KindRule:
    """One row of the verdict table: a finding kind's severity, verdict and meaning."""

    severity: Severity
    verdict: Verdict
    meaning: str
    origin: str | None = None
    """For the content kinds (leaks of data): whose data it was, in words."""
    leak_with: FindingKind | None = None
    """A finding of this kind and one of `leak_with` on the same request are a leak (the
    incident's signature: an over-limit prompt accepted and answered faster than a prefill)."""
    decisive: bool = True
    """False: a finding of this kind does not outweigh a run that could not be judged (every
    answer an error inside a 2xx tested nothing): the run is inconclusive, the finding said."""


_K = FindingKind
KIND_RULES: dict[FindingKind, KindRule] = {
    _K.CROSS_TENANT_CANARY: KindRule(
        Severity.CRITICAL,
        Verdict.LEAK,
        "a response to one tenant contains another tenant's canary: the leak itself",
        origin="a leak from another tenant",
    ),
    _K.CROSS_REQUEST_CANARY: KindRule(
        Severity.HIGH,
        Verdict.LEAK,
        "a response contains a canary of the same tenant's other request",
        origin="a leak from another request of the same tenant",
    ),
    _K.UNKNOWN_CANARY: KindRule(
        Severity.MEDIUM,
        Verdict.LEAK,
        "a canary-shaped marker no prompt of this run explains (another run's canary, not an "
        "echo of the request's own prompt): a leak of unknown origin",
        origin="a leak of unknown origin",
    ),
    _K.UNSAFE_ACCEPT: KindRule(
        Severity.CRITICAL,
        Verdict.UNSAFE,
        "a request above the pool or context limit got a success status instead of an error",
        leak_with=_K.FAST_PREFILL,
    ),
    _K.FAST_PREFILL: KindRule(
        Severity.HIGH,
        Verdict.UNSAFE,
        "TTFT far below what the prompt's length requires: the prefill was skipped",
        leak_with=_K.UNSAFE_ACCEPT,
    ),
    _K.PROMPT_TOKENS_MISMATCH: KindRule(
        Severity.HIGH, Verdict.UNSAFE, "usage.prompt_tokens differs from the tokens sent"
    ),
    _K.SHARED_PREFIX_CACHE: KindRule(
        Severity.HIGH,
        Verdict.LEAK,
        "timing shows one tenant's prompt prefix served from another tenant's cache",
    ),
    _K.POOL_SMALLER_THAN_CONTEXT: KindRule(
        Severity.HIGH,
        Verdict.UNSAFE,
        "an audit found a KV pool that cannot hold the advertised context",
    ),
    _K.ERROR_IN_SUCCESS: KindRule(
        Severity.MEDIUM,
        Verdict.UNSAFE,
        "a success status carrying an error instead of an answer (an error object or an SSE "
        "error event): clients and monitoring count a failure as a success",
        decisive=False,
    ),
    _K.CACHE_SALT_NOT_BOUND: KindRule(
        Severity.HIGH,
        Verdict.UNSAFE,
        "a tenant sending another tenant's cache_salt is served from that tenant's cache: the "
        "salt is a bearer secret, not bound to the credential; anyone who learns it reads "
        "the cache",
    ),
}
"""The verdict table's rows, one per kind (`harness.record.judgement` applies and renders
it). A kind has one severity, whichever detector finds it, except `unsafe_accept`, whose
severity follows its evidence (`harness.detectors.protocol`): this is its highest, critical;
high where the answer shows a real prefill and nothing leaked. Content kinds are leaks, each
of an origin: never an echo of the request's own prompt, which the content detector records
as `own_echo` and does not report."""
assert set(KIND_RULES) == set(FindingKind), "every finding kind has its row"
assert all(rule.origin is None or rule.verdict is Verdict.LEAK for rule in KIND_RULES.values())


@dataclass(frozen=True, slots=True)
class Finding:
    """One detected problem, with the evidence a person needs to understand it."""

    kind: FindingKind
    severity: Severity
    detector: str
    request_id: str | None
    tenant: str | None
    summary: str
    """One sentence a person on call can read: who, what, why the detector fired."""
    victim_tenant: str | None = None
    victim_request_id: str | None = None
    marker: str | None = None
    offsets: tuple[int, int] | None = None
    excerpt: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def on_request(
        cls,
        kind: FindingKind,
        detector: str,
        request_id: str | None,
        tenant: str | None,
        summary: str,
        details: dict[str, Any],
        *,
        severity: Severity | None = None,
    ) -> Finding:
        """A finding about one request (or the run, with no request id), at its kind's
        severity unless the detector weighed the evidence otherwise."""
        return cls(
            kind=kind,
            severity=kind.severity if severity is None else severity,
            detector=detector,
            request_id=request_id,
            tenant=tenant,
            summary=summary,
            details=details,
        )
