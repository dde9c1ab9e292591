"""An opt-in gateway edit to decode's body: `usage.prompt_tokens` taken from prefill.

SGLang's mini_lb and Rust sglang-router return decode's body untouched, and so does the
bundled router by default. With the engine setting `merge_prefill_usage` (off in every
preset) the router instead models a gateway that reports prefill's count of the prompt,
since prefill is the server that processed it. Everything else in the body (status, text,
completion tokens, cached tokens) stays decode's. On the vulnerable engine this is how
`prompt_tokens: 1` would reach a client: prefill served the one-token placeholder and said
so, while decode answered from pages it never got.

Only successful answers are merged; an error body, or a stream without a usage chunk,
passes through unchanged. Streams are rewritten event by event (`UsageRewriter`), and only
the usage chunk (`"choices": []` plus `usage`) is touched.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

PromptTokens = Callable[[], Awaitable[int | None]]
"""Prefill's prompt token count, awaited when decode's usage is about to pass."""


def prefill_prompt_tokens(status: int, content: bytes) -> int | None:
    """`usage.prompt_tokens` from prefill's answer (JSON or SSE), if it succeeded."""
    if status != 200:
        return None
    for payload in _json_payloads(content):
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return int(usage["prompt_tokens"])
    return None


def _json_payloads(content: bytes) -> list[Any]:
    text = content.decode(errors="replace").strip()
    if not text.startswith("data:"):
        try:
            return [json.loads(text)]
        except ValueError:
            return []
    payloads = []
    for line in text.splitlines():
        data = line.removeprefix("data:").strip()
        if line.startswith("data:") and data.startswith("{"):
            try:
                payloads.append(json.loads(data))
            except ValueError:
                continue
    return payloads


def with_prompt_tokens(body: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    usage = dict(body["usage"])
    usage["prompt_tokens"] = prompt_tokens
    usage["total_tokens"] = prompt_tokens + int(usage.get("completion_tokens") or 0)
    return {**body, "usage": usage}


async def merge_json(content: bytes, prompt_tokens: PromptTokens) -> bytes:
    """Decode's non-streaming body with prefill's prompt count."""
    try:
        body = json.loads(content)
    except ValueError:
        return content
    if not isinstance(body, dict) or not isinstance(body.get("usage"), dict):
        return content
    count = await prompt_tokens()
    if count is None:
        return content
    return json.dumps(with_prompt_tokens(body, count)).encode()


class UsageRewriter:
    """Feeds SSE bytes through, replacing `prompt_tokens` in the usage chunk."""

    def __init__(self, prompt_tokens: PromptTokens) -> None:
        self._prompt_tokens = prompt_tokens
        self._pending = b""

    async def feed(self, chunk: bytes) -> bytes:
        """The complete events in `pending + chunk`, usage rewritten; keeps the remainder."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        events = data[: end + 2].split(b"\n\n")[:-1]
        return b"".join([await self._event(e) + b"\n\n" for e in events])

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    async def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event
        try:
            body = json.loads(event[len(b"data: ") :])
        except ValueError:
            return event
        if body.get("choices") or not isinstance(body.get("usage"), dict):
            return event
        count = await self._prompt_tokens()
        if count is None:
            return event
        merged = with_prompt_tokens(body, count)
        return b"data: " + json.dumps(merged, separators=(",", ":")).encode()
