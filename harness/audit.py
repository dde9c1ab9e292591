"""The audit: can each side's KV pool hold the context the deployment advertises?

A pool smaller than the advertised context is the incident's precondition: clients are told
prompts up to the context length are fine, one side cannot hold them, and what happens next
depends on every admission check along the way being right. For each side the audit reports
pool tokens, context tokens, their ratio and a verdict (`ok`, `pool_smaller_than_context`,
`unknown`); each `pool_smaller_than_context` side is a `Finding`. A pool that could not be
read is `unknown` with the list of what was tried, never a pass.

The optional probe confirms behaviour instead of configuration: one prompt just above the
smaller of the smallest pool and the context, sent to `/v1/completions` with `max_tokens=1`,
must be refused (400, 413 or 422). A success status is an `unsafe_accept` finding; any other
answer (404, 401, 429, 5xx, a timeout) leaves the probe inconclusive.

What it deliberately does not do: read the figures (`harness.server_info`), print anything
(`harness.commands.audit`), or look inside a response's text; an accepted probe's content
may be another customer's data and is not kept.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from harness.errors import ConfigError
from harness.finding import Finding, FindingKind, Severity
from harness.limits import DEFAULT_PAGE_SIZE
from harness.server_info import (
    Attempt,
    EngineFacts,
    SideFacts,
    describe_error,
    read_deployment_facts,
)

# A common word that every tokenizer we know encodes as at least one token, and the ones we
# know best as exactly one (cl100k_base, Llama, Qwen, GLM): a probe prompt of N such words
# is at least N tokens long even when the server cannot count for us.
_FILLER_WORD = " the"
_TOKENIZE_PATHS = ("/v1/tokenize", "/tokenize")  # SGLang, then vLLM
_REJECTION_STATUSES = frozenset({400, 413, 422})  # what engines answer an over-long prompt with


class SideVerdict(StrEnum):
    """What the audit concluded about one side."""

    OK = "ok"
    POOL_SMALLER_THAN_CONTEXT = "pool_smaller_than_context"
    UNKNOWN = "unknown"


class AuditVerdict(StrEnum):
    """What the audit concluded about the deployment."""

    CLEAN = "clean"
    UNSAFE = "unsafe"
    INCONCLUSIVE = "inconclusive"


class ProbeOutcome(StrEnum):
    """What became of the over-limit probe request."""

    REJECTED = "rejected"
    ACCEPTED = "accepted"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class SideAudit:
    """One side's figures and the verdict on them."""

    side: SideFacts
    verdict: SideVerdict
    ratio: float | None
    """pool tokens / context tokens; below 1.0 the pool cannot hold one full-context prompt."""
    reason: str


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The one over-limit request the probe sent, and how the target answered it."""

    url: str
    outcome: ProbeOutcome
    limit_tokens: int | None
    """The limit the prompt was sized above (the smaller of the smallest pool and context)."""
    num_tokens: int | None
    token_count: str
    """How `num_tokens` is known: `exact (...)` from the server's tokenizer, or `at least`."""
    status: int | None = None
    error: str | None = None
    prompt_tokens_reported: int | None = None


@dataclass(frozen=True, slots=True)
class AuditResult:
    """Everything an audit found, in the form the CLI prints and `--json` emits."""

    facts: EngineFacts
    sides: tuple[SideAudit, ...]
    findings: tuple[Finding, ...]
    probe: ProbeResult | None = None

    @property
    def verdict(self) -> AuditVerdict:
        """`unsafe` on any finding; `inconclusive` when any figure or the probe is unknown."""
        if self.findings:
            return AuditVerdict.UNSAFE
        unknown = not self.sides or any(s.verdict is SideVerdict.UNKNOWN for s in self.sides)
        unconfirmed = self.probe is not None and self.probe.outcome in (
            ProbeOutcome.INCONCLUSIVE,
            ProbeOutcome.SKIPPED,
        )
        return AuditVerdict.INCONCLUSIVE if unknown or unconfirmed else AuditVerdict.CLEAN

    @property
    def exit_status(self) -> int:
        """0 clean, 1 findings, 3 inconclusive ("unknown" is not "clean")."""
        return {AuditVerdict.CLEAN: 0, AuditVerdict.UNSAFE: 1, AuditVerdict.INCONCLUSIVE: 3}[
            self.verdict
        ]

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
            "sides": [_side_record(s) for s in self.sides],
            "findings": [_finding_record(f) for f in self.findings],
            "probe": _probe_record(self.probe) if self.probe else None,
            "attempts": [_attempt_record(a) for a in self.facts.attempts],
        }


def audit_facts(facts: EngineFacts) -> AuditResult:
    """Compare each side's pool with the advertised context (no requests are made)."""
    sides = tuple(_audit_side(side, facts) for side in facts.sides)
    findings = tuple(
        _pool_finding(a, facts) for a in sides if a.verdict is SideVerdict.POOL_SMALLER_THAN_CONTEXT
    )
    return AuditResult(facts=facts, sides=sides, findings=findings)


async def run_audit(
    client: httpx.AsyncClient,
    *,
    target: str | None,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    probe: bool = False,
    model: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> AuditResult:
    """Read the deployment's facts, compare, and (with `probe`) confirm against the target."""
    if not (target or prefill_urls or decode_urls):
        raise ConfigError("audit needs --target URL, or --prefill URL / --decode URL")
    if probe and not target:
        raise ConfigError("--probe sends a request through the target; pass --target URL")
    facts = await read_deployment_facts(
        client, target=target, prefill_urls=prefill_urls, decode_urls=decode_urls, headers=headers
    )
    result = audit_facts(facts)
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
        return AuditResult(facts, result.sides, result.findings, outcome)
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
    extra = _accept_finding(outcome, side, facts)
    findings = result.findings + ((extra,) if extra else ())
    return AuditResult(facts, result.sides, findings, outcome)


async def probe_over_limit(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    limit_tokens: int,
    page_size: int,
    model: str | None,
    headers: Mapping[str, str] | None = None,
) -> ProbeResult:
    """Send one prompt of about `limit_tokens + page_size` tokens; a safe target refuses it."""
    assert limit_tokens > 0, limit_tokens
    assert page_size > 0, page_size
    base = base_url.rstrip("/")
    url = base + "/v1/completions"
    wanted = limit_tokens + page_size
    slack = max(page_size, DEFAULT_PAGE_SIZE)  # a page of 1 token is no target to aim at
    prompt, num_tokens, counted_by = await _sized_prompt(
        client, base, wanted, slack, model=model, headers=headers
    )
    body = {
        "model": model or "default",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }
    shown = redact_url(url)
    if num_tokens <= limit_tokens:  # the server's tokenizer defeated every sizing attempt
        return ProbeResult(
            shown,
            ProbeOutcome.INCONCLUSIVE,
            limit_tokens,
            num_tokens,
            counted_by,
            error="could not build a prompt above the limit",
        )
    try:
        response = await client.post(url, json=body, headers=dict(headers or {}))
    except httpx.HTTPError as exc:
        return ProbeResult(
            shown,
            ProbeOutcome.INCONCLUSIVE,
            limit_tokens,
            num_tokens,
            counted_by,
            error=describe_error(exc),
        )
    status = response.status_code
    if 200 <= status < 300:
        outcome = ProbeOutcome.ACCEPTED
    elif status in _REJECTION_STATUSES:
        outcome = ProbeOutcome.REJECTED
    else:  # 401/403/404/429/5xx say nothing about whether the length was checked
        outcome = ProbeOutcome.INCONCLUSIVE
    return ProbeResult(
        shown,
        outcome,
        limit_tokens,
        num_tokens,
        counted_by,
        status=status,
        prompt_tokens_reported=_prompt_tokens(response)
        if outcome is ProbeOutcome.ACCEPTED
        else None,
    )


def redact_url(url: str) -> str:
    """The URL without a `user:password@` part."""
    return re.sub(r"//[^/@\s]+@", "//***@", url)


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
    return Finding(
        kind=FindingKind.POOL_SMALLER_THAN_CONTEXT,
        severity=Severity.HIGH,
        detector="audit",
        request_id=None,
        tenant=None,
        summary=(
            f"{side.role} side {redact_url(side.url)}: KV pool of {pool} tokens is smaller than "
            f"the advertised context of {context} tokens (ratio {audit.ratio:.3f})"
        ),
        details={
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


def _accept_finding(probe: ProbeResult, side: SideFacts, facts: EngineFacts) -> Finding | None:
    if probe.outcome is not ProbeOutcome.ACCEPTED:
        return None
    reported = probe.prompt_tokens_reported
    return Finding(
        kind=FindingKind.UNSAFE_ACCEPT,
        severity=Severity.HIGH,
        detector="audit.probe",
        request_id=None,
        tenant=None,
        summary=(
            f"{probe.url} accepted a {probe.num_tokens}-token prompt ({probe.token_count}) above "
            f"the {probe.limit_tokens}-token limit of the {side.role} side with HTTP "
            f"{probe.status}" + (f" and usage.prompt_tokens={reported}" if reported else "")
        ),
        details={
            "url": probe.url,
            "status": probe.status,
            "num_tokens": probe.num_tokens,
            "token_count": probe.token_count,
            "limit_tokens": probe.limit_tokens,
            "pool_tokens": side.pool_tokens,
            "context_tokens": facts.context_tokens,
            "role": side.role,
            "prompt_tokens_reported": reported,
        },
    )


async def _sized_prompt(
    client: httpx.AsyncClient,
    base_url: str,
    wanted: int,
    slack: int,
    *,
    model: str | None,
    headers: Mapping[str, str] | None,
) -> tuple[str, int, str]:
    """(prompt, tokens, how counted): `wanted` to `wanted + slack` tokens where the server
    counts for us, else `wanted` words, which are at least `wanted` tokens.

    A fresh nonce leads the prompt so that no prefix cache can serve it. The filler is
    rescaled by the server's count at most twice more (a tokenizer that splits the filler
    word in two would otherwise double the request).
    """
    nonce = f"probe {secrets.token_hex(8)}:"
    num_words = wanted
    best: tuple[str, int, str] | None = None
    for _ in range(3):
        prompt = nonce + _FILLER_WORD * num_words
        counted = await _count_tokens(client, base_url, prompt, model=model, headers=headers)
        if counted is None:
            break
        count, path = counted
        if count >= wanted and (best is None or count < best[1]):
            best = (prompt, count, f"exact (server {path})")
        if wanted <= count <= wanted + slack:
            break
        num_words = max(1, -(-num_words * (wanted + slack // 2) // count))
    if best is not None:
        return best
    prompt = nonce + _FILLER_WORD * wanted
    return prompt, wanted, "at least (one token per word)"


async def _count_tokens(
    client: httpx.AsyncClient,
    base_url: str,
    prompt: str,
    *,
    model: str | None,
    headers: Mapping[str, str] | None,
) -> tuple[int, str] | None:
    body: dict[str, Any] = {"prompt": prompt}
    if model:
        body["model"] = model
    for path in _TOKENIZE_PATHS:
        try:
            response = await client.post(base_url + path, json=body, headers=dict(headers or {}))
            count = response.json().get("count") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            return count, path
    return None


def _prompt_tokens(response: httpx.Response) -> int | None:
    try:
        usage = response.json().get("usage") or {}
        value = usage.get("prompt_tokens")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def _probe_record(probe: ProbeResult) -> dict[str, Any]:
    return {
        "url": probe.url,
        "outcome": str(probe.outcome),
        "limit_tokens": probe.limit_tokens,
        "num_tokens": probe.num_tokens,
        "token_count": probe.token_count,
        "status": probe.status,
        "error": probe.error,
        "prompt_tokens_reported": probe.prompt_tokens_reported,
    }


def _attempt_record(attempt: Attempt) -> dict[str, Any]:
    return {
        "url": redact_url(attempt.url),
        "status": attempt.status,
        "error": attempt.error,
        "yielded": attempt.yielded,
    }
