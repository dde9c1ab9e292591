"""The target client: sends one planned request to an OpenAI-compatible endpoint, observes it.

`TargetClient.send` posts a `RequestPlan` to `/v1/chat/completions` (messages) or
`/v1/completions` (prompt), streaming by default, and returns an `Observation`: status,
`perf_counter_ns` timestamps, the streamed text, usage, finish reason and, where the target
misbehaved, an error kind. It never raises for anything the target does; it raises only for
the caller's mistakes (`ConfigError`: a tenant's credential variable is unset) and lets
`asyncio.CancelledError` through, so a cancelled run stops at once.

The transport is the caller's: an `httpx.AsyncClient` is injected (tests pass
`httpx.MockTransport` or `httpx.ASGITransport`; `make_http_client` builds the production one
with explicit `httpx.Limits` and `httpx.Timeout`). Requests to the production client go
straight to the transport it names (`HttpClient.direct`), others through `AsyncClient.send`.
The one retry, for a keep-alive race (a reused connection closed before any byte of the
answer), goes through a fresh one-request client of its own and is recorded in
`Observation.retry`. SSE is decoded by `sse_stream.EventDecoder`, a chunk at a time,
straight off the metered body; this module does not know what a canary is, nor what the
response text means.

Timestamps (one process, `time.perf_counter_ns`):

    t_scheduled_ns    when the runner meant to send (given by the caller)
    t_sent_ns         just before the request was handed to httpx  -> queue_ns = sent - scheduled
    t_first_byte_ns   the response head (status line and headers) arrived
    t_first_token_ns  the network read that completed the first event with text in any field
                      arrived (stamped before that event was parsed); non-streaming: the body
    t_done_ns         the response was finished with: read to its end, failed, or dropped

Every failure becomes an `ErrorKind` and a line in one place: an exception by
`transport_errors.failure_of` (its tree is drawn there), an answer that is no success here
(`_error_of`: a non-2xx status is `http_status`, a stream the harness dropped on purpose
`disconnected`, one that ended without [DONE] or a finish_reason `truncated`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.observation import ErrorKind, Observation, TextSink
from kvcanary.harness.target.bounded import take_over_decoding
from kvcanary.harness.target.http_client import HttpClient, ssl_context
from kvcanary.harness.target.http_client import default_limits as default_limits
from kvcanary.harness.target.http_client import default_timeout as default_timeout
from kvcanary.harness.target.http_client import make_http_client as make_http_client
from kvcanary.harness.target.json_body import json_content
from kvcanary.harness.target.keepalive import AttemptTrace
from kvcanary.harness.target.sse_stream import (
    EventDecoder,
    MeteredStream,
    ResponseTooLarge,
    StreamViolation,
    Transcript,
)
from kvcanary.harness.target.transport_errors import failure_of
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant

DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
ERROR_BODY_BYTES = 64 * 1024
"""How much of a non-2xx body is read; the rest is dropped with the connection."""
ERROR_EXCERPT_CHARS = 2000
_ENDPOINTS: dict[ApiStyle, str] = {"chat": "chat/completions", "completions": "completions"}


@dataclass(slots=True)
class _Exchange:
    """What happened at the HTTP level, filled in as the exchange proceeds."""

    status: int | None = None
    t_head_ns: int | None = None
    error_body: bytes = b""
    disconnected: bool = False


@dataclass(slots=True)
class _Attempt:
    """One send of a request: its connection trace, exchange, transcript and failure."""

    trace: AttemptTrace
    transcript: Transcript
    exchange: _Exchange = field(default_factory=_Exchange)
    failure: Exception | None = None
    t_sent_ns: int = 0
    t_done_ns: int = 0


class TargetClient:
    """Sends request plans to one OpenAI-compatible target and observes the responses."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        *,
        model: str,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        stream: bool = True,
        timeout: httpx.Timeout | None = None,
        deadline_s: float | None = None,
    ) -> None:
        """`base_url` is the server root or its `/v1`; `timeout` overrides the client's
        per-operation timeouts; `deadline_s` bounds a whole request, so a target that
        trickles forever (never idle long enough for a read timeout) still ends."""
        url = _parse_base_url(base_url)
        if max_response_bytes < 1024:
            raise ConfigError(f"max_response_bytes must be at least 1024, got {max_response_bytes}")
        if deadline_s is not None and not deadline_s > 0:
            raise ConfigError(f"the request deadline must be positive, got {deadline_s}")
        self._client = client
        self._base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
        self._urls = {api: httpx.URL(self.url_for(api)) for api in _ENDPOINTS}
        self.model = model
        self._max_response_bytes = max_response_bytes
        self.stream = stream
        self._timeout = timeout
        self._deadline_s = deadline_s

    def url_for(self, api: ApiStyle) -> str:
        return f"{self._base}/{_ENDPOINTS[api]}"

    def build_request(self, plan: RequestPlan, tenant: Tenant) -> httpx.Request:
        """The HTTP request for `plan`, with `tenant`'s credentials resolved now.

        Built directly, not through `AsyncClient.build_request`: the client's default headers
        are kept (under the request's own), its base URL, parameters and cookie jar are not
        used. No cookie is ever sent: one a target set in a tenant's response must not ride
        on the next tenant's request (and merging the jar costs more than the rest of the
        request)."""
        assert plan.tenant == tenant.name, (plan.tenant, tenant.name)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": plan.max_tokens,
            "temperature": 0,
            "stream": self.stream,
        }
        if plan.api == "chat":
            body["messages"] = [{"role": "user", "content": plan.prompt}]
        else:
            body["prompt"] = plan.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if tenant.cache_salt is not None:
            body["cache_salt"] = tenant.cache_salt
        # a long prompt is streamed out of the body, not copied into it (1M tokens: 6 MB)
        content = json_content(
            body, ("messages", 0, "content") if plan.api == "chat" else ("prompt",)
        )
        headers = dict(self._client.headers.items())  # lower-case names
        # identity; a target that compresses anyway is inflated by the meter, within the bound
        headers["accept-encoding"] = "identity"
        headers.update((name.lower(), value) for name, value in tenant.auth_headers().items())
        if self.stream:
            headers["accept"] = "text/event-stream"
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(content))
        timeout = self._timeout if self._timeout is not None else self._client.timeout
        return httpx.Request(
            "POST",
            self._urls[plan.api],
            headers=headers,
            content=content,
            extensions={"timeout": timeout.as_dict()},
        )

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: TextSink | None = None,
    ) -> Observation:
        """Send `plan` as `tenant`; `on_text` gets every text delta with the response field
        it is part of (`harness.target.sse_stream`: answer fields as they arrive, tool calls
        and logprobs when the response is over).

        A first attempt that fails on a reused keep-alive connection before any byte of the
        answer is sent once more on a fresh connection (`harness.target.keepalive`); the
        observation is the second attempt's, with `retry` saying why."""
        request = self.build_request(plan, tenant)
        t_wall = time.time()
        retry: str | None = None
        attempt = _Attempt(trace=AttemptTrace(), transcript=Transcript(on_text=on_text))
        try:
            async with asyncio.timeout(self._deadline_s):
                await self._attempt(self._client, request, plan, attempt)
                if attempt.trace.keepalive_race(
                    attempt.failure, attempt.exchange.status is not None
                ):
                    retry = f"{type(attempt.failure).__name__}: {attempt.failure}"
                    attempt = _Attempt(trace=AttemptTrace(), transcript=Transcript(on_text=on_text))
                    async with self._fresh_client() as fresh:
                        await self._attempt(fresh, request, plan, attempt)
        except TimeoutError as exc:  # the deadline, across both attempts
            attempt.failure = exc
        attempt.transcript.flush()  # tool calls and logprobs, however the response ended
        exchange, transcript = attempt.exchange, attempt.transcript
        error = _error_of(attempt.failure, exchange, transcript, self._deadline_s)
        text = transcript.text
        return Observation(
            request_id=plan.request_id,
            tenant=plan.tenant,
            status=exchange.status,
            t_wall=t_wall,
            t_scheduled_ns=t_scheduled_ns,
            t_sent_ns=attempt.t_sent_ns,
            t_first_byte_ns=exchange.t_head_ns,
            t_first_token_ns=transcript.t_first_token_ns,
            t_done_ns=attempt.t_done_ns,
            text=text,
            text_sha256=hashlib.sha256(text.encode()).hexdigest(),
            num_text_chars=len(text),
            num_chunks=transcript.num_chunks,
            usage=transcript.usage,
            finish_reason=transcript.finish_reason,
            error_kind=error[0] if error else None,
            error=error[1] if error else None,
            retry=retry,
        )

    async def _attempt(
        self,
        client: httpx.AsyncClient,
        request: httpx.Request,
        plan: RequestPlan,
        attempt: _Attempt,
    ) -> None:
        """One send of `request` on `client`, recorded in `attempt`, failure included."""
        request.extensions["trace"] = attempt.trace
        token = attempt.trace.activate()
        attempt.t_sent_ns = time.perf_counter_ns()
        try:
            await self._exchange(client, request, plan, attempt.exchange, attempt.transcript)
        except (httpx.HTTPError, StreamViolation, ResponseTooLarge) as exc:
            attempt.failure = exc
        finally:
            attempt.t_done_ns = time.perf_counter_ns()
            AttemptTrace.reset(token)

    def _fresh_client(self) -> httpx.AsyncClient:
        """A client that opens a new connection for its one request and keeps none."""
        return httpx.AsyncClient(
            timeout=self._client.timeout,
            limits=httpx.Limits(max_keepalive_connections=0),
            follow_redirects=False,
            trust_env=self._client.trust_env,
            verify=ssl_context(),
        )

    async def _exchange(
        self,
        client: httpx.AsyncClient,
        request: httpx.Request,
        plan: RequestPlan,
        exchange: _Exchange,
        transcript: Transcript,
    ) -> None:
        if isinstance(client, HttpClient) and client.direct is not None:
            # the transport `send` would pick anyway, without its per-request layers
            response = await client.direct.handle_async_request(request)
            response.request = request
        else:
            response = await client.send(request, stream=True)
        try:
            exchange.t_head_ns = time.perf_counter_ns()
            exchange.status = response.status_code
            assert isinstance(response.stream, httpx.AsyncByteStream)
            # the bound counts decoded bytes: the meter inflates, httpx no longer does
            codings = take_over_decoding(response)
            meter = MeteredStream(response.stream, self._max_response_bytes, codings)
            response.stream = meter
            if not response.is_success:
                bound = min(ERROR_BODY_BYTES, self._max_response_bytes)
                exchange.error_body = await _read_prefix(response, bound)
                return
            content_type = response.headers.get("content-type", "").partition(";")[0]
            content_type = content_type.strip().lower()
            if plan.disconnect_after_chunks == 0 or (
                plan.disconnect_after_chunks is not None and content_type != "text/event-stream"
            ):
                exchange.disconnected = True  # drop it before the body: mid-prefill abort
                return
            if content_type == "text/event-stream":
                await _read_events(meter, plan, exchange, transcript)
            elif content_type == "application/json" or content_type.endswith("+json"):
                # a non-streaming answer (asked for, or a target ignoring `stream: true`)
                body = await response.aread()
                transcript.take_body(body, meter.t_last_read_ns or time.perf_counter_ns())
            else:
                raise StreamViolation(f"unexpected content-type {content_type!r} after HTTP 200")
        finally:
            await response.aclose()


async def _read_events(
    meter: MeteredStream,
    plan: RequestPlan,
    exchange: _Exchange,
    transcript: Transcript,
) -> None:
    """Every event of the body, each stamped with the read that completed it; the meter is
    read directly (one async layer per network read, none per line or event)."""
    limit = plan.disconnect_after_chunks
    decoder = EventDecoder()
    chunks_of = cast(AsyncGenerator[bytes, None], aiter(meter))  # it is one
    async with contextlib.aclosing(chunks_of) as chunks:
        async for chunk in chunks:
            t_read_ns = meter.t_last_read_ns
            assert t_read_ns is not None  # stamped before the chunk was yielded
            for event, data in decoder.feed(chunk):
                transcript.take_event(event, data, t_read_ns)
                if limit is not None and transcript.num_chunks >= limit and not transcript.complete:
                    exchange.disconnected = True
                    return
    for event, data in decoder.flush():
        transcript.take_event(event, data, meter.t_last_read_ns or time.perf_counter_ns())
    # past [DONE] the loop kept reading to the end of the body, so the connection is reused


async def _read_prefix(response: httpx.Response, num_bytes: int) -> bytes:
    body = bytearray()
    chunks_of = cast(AsyncGenerator[bytes, None], response.aiter_bytes())  # it is one
    async with contextlib.aclosing(chunks_of) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) >= num_bytes:
                break
    return bytes(body[:num_bytes])


def _error_of(
    failure: Exception | None,
    exchange: _Exchange,
    transcript: Transcript,
    deadline_s: float | None,
) -> tuple[ErrorKind, str] | None:
    """What went wrong, as an error kind and a one-line message (None: nothing did)."""
    if failure is None:
        if exchange.status is not None and not 200 <= exchange.status < 300:
            body = exchange.error_body.decode("utf-8", errors="replace")
            return "http_status", f"HTTP {exchange.status}: {body[:ERROR_EXCERPT_CHARS]}"
        if exchange.disconnected:
            return "disconnected", f"dropped by the harness after {transcript.num_chunks} chunks"
        if not transcript.complete:
            return "truncated", "the response ended without [DONE] or a finish_reason"
        return None
    return failure_of(failure, got_head=exchange.status is not None, deadline_s=deadline_s)


def _parse_base_url(base_url: str) -> str:
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"target URL {base_url!r} is not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"target URL {base_url!r} must start with http:// or https://")
    return str(url)
