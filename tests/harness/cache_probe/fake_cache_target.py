"""A fake OpenAI-compatible target with a page-granular prefix cache, for the probe's tests.

A raw ASGI app serving `/v1/completions` (streaming and not). The prompt is tokenized with
cl100k_base; whole pages of it that an earlier request in the same cache namespace already
had are "cached". The first token is delayed by `base_s + per_token_s * uncached tokens`,
so a hit really is faster, and usage reports `prompt_tokens_details.cached_tokens` (unless
`report_cached` is off; with `loaded_as_cached`, as a disaggregated vLLM's decode does, the
whole prompt but its last token on every request, hit or miss: the KV it loaded from
prefill). `GET /metrics` counts the real hits as vLLM does (`vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`, unless `serve_metrics` is off); any other GET is a 404.
Cache modes:

    off       no cache: every request is a miss
    shared    one namespace for everyone (a cross-tenant leak)
    salted    namespaced by the body's `cache_salt` (trusted from the client, vLLM)
    derived   namespaced by the Authorization header (the server derives the salt)
    constant  cache as `shared`, but the delay ignores it (only cached_tokens shows hits)

Under a `VirtualClock` installed as `time.perf_counter_ns` (the clock every observation's
timestamps come from), the delay is charged to that clock instead of slept: the TTFT the
client measures then holds it exactly, however loaded the machine, and a delay far above
any scheduling noise costs no wall time. Real overheads (HTTP, tokenizing) still add to it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvcanary.canaries import Tokenizer, load_tokenizer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class VirtualClock:
    """`time.perf_counter_ns` plus every delay charged to it with `advance`."""

    def __init__(self) -> None:
        self._real = time.perf_counter_ns
        self.offset_ns = 0

    def __call__(self) -> int:
        return self._real() + self.offset_ns

    def advance(self, seconds: float) -> None:
        self.offset_ns += round(seconds * 1e9)


@dataclass
class FakeCacheTarget:
    mode: str = "shared"
    page_size: int = 16
    base_s: float = 0.005
    per_token_s: float = 1e-3
    """Sized for a `VirtualClock`: a 256-token miss is charged 0.26 s, a hit on 224 of
    them 0.04 s, so a loaded machine's milliseconds of noise never blur the two."""
    report_cached: bool = True
    loaded_as_cached: bool = False
    serve_metrics: bool = True
    tokenizer: Tokenizer = field(default_factory=lambda: load_tokenizer("cl100k_base"))
    pages: set[tuple[Any, tuple[int, ...]]] = field(default_factory=set)
    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_gets: int = 0

    def namespace(self, body: dict[str, Any], headers: dict[bytes, bytes]) -> Any:
        if self.mode == "salted":
            return body.get("cache_salt")
        if self.mode == "derived":
            return headers.get(b"authorization")
        return None

    def serve(self, ids: list[int], namespace: Any) -> int:
        """Cached tokens for `ids`; then its whole pages join the cache."""
        if self.mode == "off":
            return 0
        num_pages = (len(ids) - 1) // self.page_size  # the last token is always computed
        cached = 0
        for k in range(1, num_pages + 1):
            if (namespace, tuple(ids[: k * self.page_size])) not in self.pages:
                break
            cached = k * self.page_size
        for k in range(1, len(ids) // self.page_size + 1):
            self.pages.add((namespace, tuple(ids[: k * self.page_size])))
        return cached

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            await self.get(scope["path"], send)
            return
        body = json.loads(raw)
        headers = dict(scope["headers"])
        ids = self.tokenizer.encode(body["prompt"])
        self.num_requests += 1
        cached = self.serve(ids, self.namespace(body, headers))
        self.num_queried_tokens += len(ids)
        self.num_hit_tokens += cached
        uncached = len(ids) if self.mode == "constant" else len(ids) - cached
        if self.loaded_as_cached:
            cached = len(ids) - 1
        delay_s = self.base_s + self.per_token_s * uncached
        clock = time.perf_counter_ns
        if isinstance(clock, VirtualClock):
            clock.advance(delay_s)
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(delay_s)
        details = {"cached_tokens": cached} if self.report_cached else None
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        if details is not None:
            usage["prompt_tokens_details"] = details  # type: ignore[assignment]
        choice = {"index": 0, "text": " x", "finish_reason": "length"}
        if body.get("stream"):
            events = [{"choices": [choice]}, {"choices": [], "usage": usage}]
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            payload += b"data: [DONE]\n\n"
            content_type = b"text/event-stream"
        else:
            payload = json.dumps({"choices": [choice], "usage": usage}).encode()
            content_type = b"application/json"
        await _respond(send, 200, content_type, payload)

    async def get(self, path: str, send: Send) -> None:
        self.num_gets += 1
        if path != "/metrics" or not self.serve_metrics:
            await _respond(send, 404, b"application/json", b'{"error": "not found"}')
            return
        lines = [
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{engine="0"}} {float(self.num_queried_tokens)}',
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{engine="0"}} {float(self.num_hit_tokens)}',
        ]
        await _respond(send, 200, b"text/plain; version=0.0.4", "\n".join(lines).encode() + b"\n")


async def _respond(send: Send, status: int, content_type: bytes, payload: bytes) -> None:
    start = {"type": "http.response.start", "status": status}
    await send({**start, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
