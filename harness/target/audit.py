"""The audit: can each side's KV pool hold the context the deployment advertises?

A pool smaller than the advertised context is the incident's precondition: clients are told
prompts up to the context length are fine, one side cannot hold them, and what happens next
depends on every admission check along the way being right. For each side the audit reports
pool tokens, context tokens, their ratio and a verdict (`ok`, `pool_smaller_than_context`,
`unknown`); each `pool_smaller_than_context` side is a `Finding`. A pool that could not be
read is `unknown` with the list of what was tried, never a pass.

Figures the target did not report can be given (`--pool-tokens`, `--context-tokens`): a given
figure fills in what was not read, never replaces what was (the audit is about what the
deployment says of itself), and `AuditResult.figures` says of each figure whether it was read
(and where) or given.

The optional probe confirms behaviour instead of configuration: one prompt just above the
smaller of the smallest pool and the context, sent to `/v1/completions` with `max_tokens=1`,
must be refused (400, 413 or 422). A success status is an `unsafe_accept` finding; any other
answer (404, 401, 429, 5xx, a timeout) leaves the probe inconclusive.

What it deliberately does not do: read the figures (`harness.target.server_info`), print anything
(`harness.commands.audit`), or look inside a response's text; an accepted probe's content
may be another customer's data and is not kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

import httpx

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.target.limits import DEFAULT_PAGE_SIZE
from kvcanary.harness.target.over_limit_probe import (
    ProbeOutcome,
    ProbeResult,
    accept_finding,
    probe_over_limit,
    probe_record,
)
from kvcanary.harness.target.server_info import (
    Attempt,
    EngineFacts,
    SideFacts,
    read_deployment_facts,
)
from kvcanary.harness.target.urls import redact_url

GIVEN_POOL = "given: --pool-tokens"
GIVEN_CONTEXT = "given: --context-tokens"


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure the audit compared, and whether it was read from the target or given."""

    name: str
    """`pool_tokens` or `context_tokens`."""
    where: str
    """The side (`unified http://...`), or `advertised` for the deployment's context."""
    value: int | None
    source: str
    """`read: <source>`, `given: --pool-tokens`, or `unknown`."""
    note: str = ""
    """Where a given figure was not used because the target reported its own."""

    def describe(self) -> str:
        value = "unknown" if self.value is None else f"{self.value:,}"
        return f"{self.name} {value} ({self.where}): {self.source}" + (
            f"; {self.note}" if self.note else ""
        )


class SideVerdict(StrEnum):
    """What the audit concluded about one side."""

    OK = "ok"
    POOL_SMALLER_THAN_CONTEXT = FindingKind.POOL_SMALLER_THAN_CONTEXT.value
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class SideAudit:
    """One side's figures and the verdict on them."""

    side: SideFacts
    verdict: SideVerdict
    ratio: float | None
    """pool tokens / context tokens; below 1.0 the pool cannot hold one full-context prompt."""
    reason: str


@dataclass(frozen=True, slots=True)
class AuditResult:
    """Everything an audit found, in the form the CLI prints and `--json` emits."""

    facts: EngineFacts
    sides: tuple[SideAudit, ...]
    findings: tuple[Finding, ...]
    probe: ProbeResult | None = None
    figures: tuple[Figure, ...] = ()
    """Each figure compared, read or given (`given_figures`)."""

    @property
    def verdict(self) -> Verdict:
        """`unsafe` on any finding; `inconclusive` when any figure or the probe is unknown."""
        if self.findings:
            return Verdict.UNSAFE
        unknown = not self.sides or any(s.verdict is SideVerdict.UNKNOWN for s in self.sides)
        unconfirmed = self.probe is not None and self.probe.outcome in (
            ProbeOutcome.INCONCLUSIVE,
            ProbeOutcome.SKIPPED,
        )
        return Verdict.INCONCLUSIVE if unknown or unconfirmed else Verdict.CLEAN

    @property
    def exit_status(self) -> int:
        """0 clean, 1 findings, 3 inconclusive ("unknown" is not "clean")."""
        return self.verdict.exit_status

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary; URLs are shown without any credentials they carried."""
        return {
            "verdict": str(self.verdict),
            "exit_status": self.exit_status,
            "target": redact_url(self.facts.base_url),
            "engine": self.facts.engine,
            "model": self.facts.model,
            "context_tokens": self.facts.context_tokens,
            "context_source": self.facts.context_source,
            "figures": [asdict(f) for f in self.figures],
            "sides": [_side_record(s) for s in self.sides],
            "findings": [_finding_record(f) for f in self.findings],
            "probe": probe_record(self.probe) if self.probe else None,
            "attempts": [_attempt_record(a) for a in self.facts.attempts],
        }


def audit_facts(
    facts: EngineFacts, *, pool_tokens: int | None = None, context_tokens: int | None = None
) -> AuditResult:
    """Compare each side's pool with the advertised context (no requests are made); given
    figures fill in what the target did not report."""
    facts, figures = given_figures(facts, pool_tokens=pool_tokens, context_tokens=context_tokens)
    sides = tuple(_audit_side(side, facts) for side in facts.sides)
    findings = tuple(
        _pool_finding(a, facts) for a in sides if a.verdict is SideVerdict.POOL_SMALLER_THAN_CONTEXT
    )
    return AuditResult(facts=facts, sides=sides, findings=findings, figures=figures)


def given_figures(
    facts: EngineFacts, *, pool_tokens: int | None, context_tokens: int | None
) -> tuple[EngineFacts, tuple[Figure, ...]]:
    """`facts` with the given figures filled in where none was read, and every figure's
    source. A deployment that reported no side at all gets one unified side."""
    for flag, value in (("--pool-tokens", pool_tokens), ("--context-tokens", context_tokens)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be a positive number of tokens, got {value}")
    sides = list(facts.sides)
    if not sides and (pool_tokens is not None or context_tokens is not None):
        sides = [SideFacts("unified", facts.base_url, None, None, None, None)]
    context, context_source = facts.context_tokens, facts.context_source
    figures = [_figure("context_tokens", "advertised", context, context_source, context_tokens)]
    if context is None and context_tokens is not None:
        context, context_source = context_tokens, GIVEN_CONTEXT
    filled: list[SideFacts] = []
    for side in sides:
        where = f"{side.role} {redact_url(side.url)}"
        figures.append(_figure("pool_tokens", where, side.pool_tokens, side.source, pool_tokens))
        if side.pool_tokens is None and pool_tokens is not None:
            side = replace(side, pool_tokens=pool_tokens, source=GIVEN_POOL)
        if side.context_tokens is None and context is not None:
            side = replace(side, context_tokens=context)
        filled.append(side)
    facts = replace(
        facts, sides=tuple(filled), context_tokens=context, context_source=context_source
    )
    return facts, tuple(figures)


def _figure(
    name: str, where: str, read: int | None, source: str | None, given: int | None
) -> Figure:
    flag = GIVEN_POOL if name == "pool_tokens" else GIVEN_CONTEXT
    if read is None:
        if given is None:
            return Figure(name, where, None, "unknown")
        return Figure(name, where, given, flag)
    figure = Figure(name, where, read, f"read: {source or 'the target'}")
    if given is not None and given != read:
        return replace(figure, note=f"{flag.removeprefix('given: ')} {given} not used")
    return figure


async def run_audit(
    client: httpx.AsyncClient,
    *,
    target: str | None,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    probe: bool = False,
    model: str | None = None,
    headers: Mapping[str, str] | None = None,
    pool_tokens: int | None = None,
    context_tokens: int | None = None,
) -> AuditResult:
    """Read the deployment's facts, compare, and (with `probe`) confirm against the target."""
    if not (target or prefill_urls or decode_urls):
        raise ConfigError("audit needs --target URL, or --prefill URL / --decode URL")
    if probe and not target:
        raise ConfigError("--probe sends a request through the target; pass --target URL")
    facts = await read_deployment_facts(
        client, target=target, prefill_urls=prefill_urls, decode_urls=decode_urls, headers=headers
    )
    result = audit_facts(facts, pool_tokens=pool_tokens, context_tokens=context_tokens)
    facts = result.facts
    if not probe:
        return result
    assert target is not None
    side = facts.smallest_pool_side()
    if side is None or side.pool_tokens is None:
        outcome = ProbeResult(
            url=redact_url(target.rstrip("/") + "/v1/completions"),
            outcome=ProbeOutcome.SKIPPED,
            limit_tokens=None,
            num_tokens=None,
            token_count="",
            error="no pool size was read, so there is no limit to probe above",
        )
        return replace(result, probe=outcome)
    context = side.context_tokens or facts.context_tokens
    # above the pool, and above the context too when that is smaller: both must be refused
    limit = min(side.pool_tokens, context) if context else side.pool_tokens
    page_size = side.page_size or facts.page_size or DEFAULT_PAGE_SIZE
    outcome = await probe_over_limit(
        client,
        target,
        limit_tokens=limit,
        page_size=page_size,
        model=model or facts.model,
        headers=headers,
    )
    extra = accept_finding(outcome, side, facts)
    findings = result.findings + ((extra,) if extra else ())
    return replace(result, findings=findings, probe=outcome)


def _audit_side(side: SideFacts, facts: EngineFacts) -> SideAudit:
    pool, context = side.pool_tokens, side.context_tokens or facts.context_tokens
    if pool is None:
        return SideAudit(side, SideVerdict.UNKNOWN, None, "could not read the KV pool size")
    if context is None:
        return SideAudit(side, SideVerdict.UNKNOWN, None, "could not read the context length")
    ratio = pool / context
    if pool >= context:
        return SideAudit(side, SideVerdict.OK, ratio, "the pool holds a full-context prompt")
    return SideAudit(
        side,
        SideVerdict.POOL_SMALLER_THAN_CONTEXT,
        ratio,
        f"a prompt of {pool + 1}..{context} tokens is advertised as valid but does not fit",
    )


def _pool_finding(audit: SideAudit, facts: EngineFacts) -> Finding:
    side = audit.side
    pool, context = side.pool_tokens, side.context_tokens or facts.context_tokens
    assert pool is not None, side
    assert context is not None, side
    assert audit.ratio is not None, audit
    others = [
        {"role": s.role, "url": redact_url(s.url), "pool_tokens": s.pool_tokens}
        for s in facts.sides
        if s is not side
    ]
    return Finding.on_request(
        FindingKind.POOL_SMALLER_THAN_CONTEXT,
        "audit",
        None,
        None,
        (
            f"{side.role} side {redact_url(side.url)}: KV pool of {pool} tokens is smaller than "
            f"the advertised context of {context} tokens (ratio {audit.ratio:.3f})"
        ),
        {
            "role": side.role,
            "url": redact_url(side.url),
            "engine": facts.engine,
            "pool_tokens": pool,
            "context_tokens": context,
            "ratio": round(audit.ratio, 6),
            "max_input_tokens": side.max_input_tokens,
            "page_size": side.page_size,
            "pool_source": side.source,
            "context_source": facts.context_source
            if side.context_tokens == facts.context_tokens
            else side.source,
            "source_fields": side.fields,
            "other_sides": others,
        },
    )


def _side_record(audit: SideAudit) -> dict[str, Any]:
    side = audit.side
    return {
        "role": side.role,
        "url": redact_url(side.url),
        "pool_tokens": side.pool_tokens,
        "context_tokens": side.context_tokens,
        "max_input_tokens": side.max_input_tokens,
        "page_size": side.page_size,
        "ratio": None if audit.ratio is None else round(audit.ratio, 6),
        "verdict": str(audit.verdict),
        "reason": audit.reason,
        "source": side.source,
    }


def _finding_record(finding: Finding) -> dict[str, Any]:
    return {
        "kind": str(finding.kind),
        "severity": str(finding.severity),
        "detector": finding.detector,
        "summary": finding.summary,
        "details": finding.details,
    }


def _attempt_record(attempt: Attempt) -> dict[str, Any]:
    return {
        "url": redact_url(attempt.url),
        "status": attempt.status,
        "error": attempt.error,
        "yielded": attempt.yielded,
    }


__all__ = [
    "AuditResult",
    "Figure",
    "ProbeOutcome",
    "ProbeResult",
    "SideAudit",
    "SideVerdict",
    "audit_facts",
    "probe_over_limit",
    "redact_url",
    "run_audit",
]
