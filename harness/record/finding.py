"""The finding vocabulary shared by detectors, the journal, reports and the pytest plugin.

A finding is one reason to believe a target is unsafe. Its kind is drawn from the fixed
vocabulary in DESIGN.md; everything a human needs to act on it travels with it. Excerpts of
responses are redacted by the detector that creates the finding, never later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FindingKind(StrEnum):
    """What kind of unsafe behaviour a finding reports."""

    CROSS_TENANT_CANARY = "cross_tenant_canary"
    CROSS_REQUEST_CANARY = "cross_request_canary"
    UNKNOWN_CANARY = "unknown_canary"
    UNSAFE_ACCEPT = "unsafe_accept"
    FAST_PREFILL = "fast_prefill"
    PROMPT_TOKENS_MISMATCH = "prompt_tokens_mismatch"
    SHARED_PREFIX_CACHE = "shared_prefix_cache"
    POOL_SMALLER_THAN_CONTEXT = "pool_smaller_than_context"
    ERROR_IN_SUCCESS = "error_in_success"

    @property
    def severity(self) -> Severity:
        """The one severity of this kind, wherever a detector or the audit reports it."""
        return SEVERITY_BY_KIND[self]

    @property
    def leak(self) -> str | None:
        """What a finding of this kind says about a leak (`LEAK_BY_KIND`), or None for the
        kinds that show unsafe behaviour rather than leaked data."""
        return LEAK_BY_KIND.get(self)


class Severity(StrEnum):
    """How urgently a human should look."""

    CRITICAL = "critical"
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


SEVERITY_BY_KIND: dict[FindingKind, Severity] = {
    FindingKind.CROSS_TENANT_CANARY: Severity.CRITICAL,
    FindingKind.CROSS_REQUEST_CANARY: Severity.HIGH,
    FindingKind.UNKNOWN_CANARY: Severity.MEDIUM,
    FindingKind.UNSAFE_ACCEPT: Severity.CRITICAL,
    FindingKind.FAST_PREFILL: Severity.HIGH,
    FindingKind.PROMPT_TOKENS_MISMATCH: Severity.HIGH,
    FindingKind.SHARED_PREFIX_CACHE: Severity.HIGH,
    FindingKind.POOL_SMALLER_THAN_CONTEXT: Severity.HIGH,
    FindingKind.ERROR_IN_SUCCESS: Severity.MEDIUM,
}
"""Defined next to the kinds: a kind has one severity, whichever detector finds it, except
`unsafe_accept`, whose severity follows its evidence (`harness.detectors.protocol`): this is
its highest, critical; high where the answer shows a real prefill and nothing leaked."""

LEAK_BY_KIND: dict[FindingKind, str] = {
    FindingKind.CROSS_TENANT_CANARY: "a leak from another tenant",
    FindingKind.CROSS_REQUEST_CANARY: "a leak from another request of the same tenant",
    FindingKind.UNKNOWN_CANARY: "a leak of unknown origin",
}
"""The content kinds are leaks, each of an origin: another tenant's canary, the same
tenant's other request's, or a canary-shaped marker that no prompt of this run explains
(another run's canary, or one this run forgot; never an echo of the request's own prompt,
which the content detector records as `own_echo` and does not report)."""
assert LEAK_BY_KIND.keys() <= SEVERITY_BY_KIND.keys() == set(FindingKind)


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
