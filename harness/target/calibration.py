"""Calibration: the tokens a target adds to every prompt of one API, measured once at start.

A server counts more than the prompt's own tokens: llama.cpp (and most Llama-family
deployments) prepend a BOS token to every completions prompt, so `usage.prompt_tokens` is
`sent + 1` on every answer; a chat template adds its own tokens around the message. One short
request per API, shaped like the planned prompts (a leading space and the canary tag first),
gives the offset:

    offset = usage.prompt_tokens (as the server reports it) - tokens counted for that request

where the count is the tokenizer's, plus the chat template's overhead for chat prompts when
the planner already counts it (`chat_overhead_tokens`). The protocol detector compares each
answer's usage net of this offset (`ProtocolDetector(prompt_token_offsets=...)`), and names
it in a `prompt_tokens_mismatch`. The calibration prompt is tiny, far below any limit, so a
target that misreports usage only for over-long prompts (the incident) calibrates normally.

What it does not do: decide sizes (the planner), or accept an offset that makes the server's
count smaller than the tokenizer's: that is the wrong tokenizer, a `ConfigError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvcanary.canaries import TAG, Tokenizer
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.redact import redact_quote
from kvcanary.harness.record.events import Limits
from kvcanary.harness.target.bounded import ResponseTooLarge, StreamViolation, loads
from kvcanary.harness.target.discovery_fetch import post_bounded
from kvcanary.harness.target.sse_stream import MAX_TOKEN_COUNT
from kvcanary.tenants.plan import ApiStyle
from kvcanary.tenants.planner import CHAT_INSTRUCTION
from kvcanary.tenants.tenant import Tenant

CALIBRATION_TEXT = f" {TAG} The river was quiet.\n\n{CHAT_INSTRUCTION}"
"""Starts like every planned prompt (its canary tag) and ends like a chat prompt (the
planner's instruction), so the tokens a server or template adds at each end are the same."""
_PATHS: dict[ApiStyle, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class PromptTokenOffset:
    """What one calibration request measured for one API."""

    api: ApiStyle
    url: str
    num_counted: int
    """The request's prompt tokens as kvcanary counts them (chat: template overhead included)."""
    num_reported: int | None
    """`usage.prompt_tokens` of the answer; None when it carried none."""

    @property
    def offset(self) -> int:
        """Tokens the server adds to every prompt of this API (0 when nothing was reported)."""
        return 0 if self.num_reported is None else self.num_reported - self.num_counted

    def describe(self) -> str:
        if self.num_reported is None:
            return f"{self.api}: {self.url} reported no usage; no offset applied"
        return (
            f"{self.api}: the server counts {self.offset:+d} token(s) on every prompt "
            f"({self.num_reported} reported for {self.num_counted} sent, {self.url})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "offset": self.offset}


async def measure_prompt_token_offset(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    api: ApiStyle,
    tokenizer: Tokenizer,
    tenant: Tenant,
    *,
    chat_overhead_tokens: int = 0,
) -> PromptTokenOffset:
    """Send one short `api` request and compare its `usage.prompt_tokens` with the count.

    `chat_overhead_tokens` is what the planner adds for the chat template (0 for
    completions). A request that fails or answers without JSON is a `ConfigError` (the target
    cannot serve the run's API); an answer without usage measures nothing (offset 0).
    """
    if api not in _PATHS:
        raise ConfigError(f"calibration: unknown API {api!r}")
    url = base_url.rstrip("/") + _PATHS[api]
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0, "stream": False}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": CALIBRATION_TEXT}]
    else:
        body["prompt"] = CALIBRATION_TEXT
    # a server tokenizer blocks its thread on this loop, so count from another thread
    counted = await asyncio.to_thread(tokenizer.count, CALIBRATION_TEXT)
    counted += chat_overhead_tokens if api == "chat" else 0
    try:
        status, content = await post_bounded(
            http, url, json_body=body, headers=tenant.auth_headers()
        )
    except (httpx.HTTPError, ResponseTooLarge, StreamViolation) as exc:
        raise ConfigError(f"calibration request to {url} failed ({exc!r})") from None
    # the body is the target's text (perhaps another customer's): a length and a hash of it
    text = content[:200].decode("utf-8", errors="replace")
    if status != 200:
        raise ConfigError(
            redact_quote(f"calibration request to {url} answered HTTP {status}: {text!r}")
        )
    try:
        answer = loads(content)
    except StreamViolation:
        raise ConfigError(
            redact_quote(f"calibration request to {url} answered 200 without JSON: {text!r}")
        ) from None
    result = PromptTokenOffset(api, url, counted, _prompt_tokens(answer))
    if result.offset < 0:
        raise ConfigError(
            f"{url} counts {result.num_reported} prompt tokens where --tokenizer "
            f"{tokenizer.name} counts {counted}: give the model's tokenizer "
            "(--tokenizer PATH/tokenizer.json, or --tokenizer server)"
        )
    return result


def _prompt_tokens(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value if 0 <= value <= MAX_TOKEN_COUNT else None


def planning_limits(limits: Limits, calibration: PromptTokenOffset | None) -> Limits:
    """The limits in kvcanary's own token count: a `limit-1` victim is then `limit-1` tokens
    as the server counts them (its added tokens included)."""
    offset = calibration.offset if calibration is not None else 0
    if offset == 0:
        return limits
    return dataclasses.replace(
        limits,
        pool_tokens=limits.pool_tokens - offset,
        context_tokens=limits.context_tokens - offset,
    )
