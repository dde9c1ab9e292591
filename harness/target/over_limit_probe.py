"""The over-limit probe: one prompt just above a limit, which a safe target refuses.

It confirms behaviour instead of configuration: a prompt of about `limit + page_size`
tokens, sized with the server's own tokenizer where it has one, is sent to `/v1/completions`
with `max_tokens=1`. A rejection (400, 413, 422) is what a safe target answers; a success
status is an `unsafe_accept` finding; anything else (404, 401, 429, 5xx, a timeout) leaves
the probe inconclusive. An accepted probe's content may be another customer's data and is
not kept.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import httpx

from kvcanary.canaries import RemoteTokenizer
from kvcanary.canaries.errors import CanaryError
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.target.bounded import ResponseTooLarge, StreamViolation, loads
from kvcanary.harness.target.discovery_fetch import post_bounded
from kvcanary.harness.target.limits import DEFAULT_PAGE_SIZE
from kvcanary.harness.target.server_info import EngineFacts, SideFacts, describe_error
from kvcanary.harness.target.sse_stream import MAX_TOKEN_COUNT
from kvcanary.harness.target.tokenizer import bounded_post
from kvcanary.harness.target.urls import redact_url

# A common word that every tokenizer we know encodes as at least one token, and the ones we
# know best as exactly one (cl100k_base, Llama, Qwen, GLM): a probe prompt of N such words
# is at least N tokens long even when the server cannot count for us.
_FILLER_WORD = " the"
_REJECTION_STATUSES = frozenset({400, 413, 422})  # what engines answer an over-long prompt with


class ProbeOutcome(StrEnum):
    """What became of the over-limit probe request."""

    REJECTED = "rejected"
    ACCEPTED = "accepted"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


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
    slack = max(page_size, DEFAULT_PAGE_SIZE)  # a page of 1 token is no target to aim at
    prompt, num_tokens, counted_by = await _sized_prompt(
        client, base, limit_tokens + page_size, slack, model=model, headers=headers
    )
    sized = ProbeResult(
        redact_url(url), ProbeOutcome.INCONCLUSIVE, limit_tokens, num_tokens, counted_by
    )
    if num_tokens <= limit_tokens:  # the server's tokenizer defeated every sizing attempt
        return replace(sized, error="could not build a prompt above the limit")
    body = {"model": model or "default", "prompt": prompt, "max_tokens": 1}
    body |= {"temperature": 0, "stream": False}
    try:
        status, content = await post_bounded(client, url, json_body=body, headers=headers)
    except (httpx.HTTPError, ResponseTooLarge, StreamViolation) as exc:
        return replace(sized, error=describe_error(exc))
    if 200 <= status < 300:
        return replace(
            sized,
            outcome=ProbeOutcome.ACCEPTED,
            status=status,
            prompt_tokens_reported=_prompt_tokens(content),
        )
    # 401/403/404/429/5xx say nothing about whether the length was checked
    rejected = status in _REJECTION_STATUSES
    return replace(
        sized, outcome=ProbeOutcome.REJECTED if rejected else sized.outcome, status=status
    )


def accept_finding(probe: ProbeResult, side: SideFacts, facts: EngineFacts) -> Finding | None:
    if probe.outcome is not ProbeOutcome.ACCEPTED:
        return None
    reported = probe.prompt_tokens_reported
    return Finding.on_request(
        FindingKind.UNSAFE_ACCEPT,
        "audit.probe",
        None,
        None,
        (
            f"{probe.url} accepted a {probe.num_tokens}-token prompt ({probe.token_count}) above "
            f"the {probe.limit_tokens}-token limit of the {side.role} side with HTTP "
            f"{probe.status}" + (f" and usage.prompt_tokens={reported}" if reported else "")
        ),
        {
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
    remote = await _server_tokenizer(client, base_url, model=model, headers=headers)
    for _ in range(3 if remote is not None else 0):
        assert remote is not None
        prompt = nonce + _FILLER_WORD * num_words
        counted = await _count_tokens(remote, prompt)
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


async def _server_tokenizer(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str | None,
    headers: Mapping[str, str] | None,
) -> RemoteTokenizer | None:
    """The server's tokenize route in its own convention (SGLang, vLLM, llama.cpp), or None
    when it has none whose counts are plausible."""
    remote = RemoteTokenizer(
        client, base_url, headers=headers, model=model, post=bounded_post(client)
    )
    try:
        await remote.detect()
    except (CanaryError, httpx.HTTPError):
        return None
    return remote


async def _count_tokens(remote: RemoteTokenizer, prompt: str) -> tuple[int, str] | None:
    """(tokens, the route that counted them), or None when the route failed this time."""
    try:
        count = await remote.count(prompt)
    except (CanaryError, httpx.HTTPError):
        return None
    return count, httpx.URL(remote.endpoint).path


def _prompt_tokens(content: bytes) -> int | None:
    try:
        usage = loads(content).get("usage") or {}
        value = usage.get("prompt_tokens")
    except (StreamViolation, AttributeError):
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value if 0 <= value <= MAX_TOKEN_COUNT else None


def probe_record(probe: ProbeResult) -> dict[str, Any]:
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
