"""The production HTTP client for `harness.target.client.TargetClient`: explicit limits and
timeouts sized for long prompts and many concurrent streams, on one of two I/O backends.

    aiohttp (default)  the httpx API over aiohttp's I/O (`httpx-aiohttp`): per-request CPU
                       stays flat with the number of open connections
    httpx              httpx's own httpcore pool: walks every connection on each acquire and
                       release, so at hundreds of streams the client measures its own queueing
                       instead of the target's TTFT (benchmarks/RESULTS-client.md)

The client is an `HttpClient`, an `httpx.AsyncClient` that names its one transport, so
`TargetClient` hands its requests to that transport directly: `AsyncClient.send`'s own
layers (auth and redirect flows, cookie jar, response wrapping) measured a third of
aiohttp's whole exchange again in CPU per request, and a target client needs none of them
(benchmarks/RESULTS-client.md). Where the environment names a proxy (`HTTP_PROXY`, ...),
httpx's own routing is kept: the client names no transport and every request goes through
`send`.

Both raise the same `httpx` exceptions, and both feed the keep-alive retry
(`harness.target.keepalive`): httpcore through its `trace` extension, aiohttp through a
`TraceConfig`. aiohttp's "Server disconnected" before a response head is mapped here, in one
place, to the `httpx.RemoteProtocolError` httpcore raises for it (httpx-aiohttp would call it
a connect timeout).
"""

from __future__ import annotations

import functools
import ssl
import urllib.request
from typing import Final, Literal

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from kvcanary.harness.target.keepalive import aiohttp_trace_config

Backend = Literal["aiohttp", "httpx"]
BACKENDS: Final[tuple[Backend, ...]] = ("aiohttp", "httpx")
DEFAULT_BACKEND: Final[Backend] = "aiohttp"
_UNWRITABLE = "Can not write request body"
"""aiohttp's error for a request written to a connection the server has closed."""
_READ_BUFFER_BYTES = 256 * 1024
"""aiohttp's per-connection read buffer: a whole burst of SSE events is one read."""


def default_timeout() -> httpx.Timeout:
    """Per-operation timeouts for long prompts.

    `read` bounds the wait for *each* read, including the first one, which comes only after
    the whole prompt is prefilled: minutes for a million tokens. `pool` is unbounded because
    the runner, not httpx's pool, limits concurrency (and times the queueing itself).
    """
    return httpx.Timeout(connect=10.0, read=300.0, write=60.0, pool=None)


def default_limits(max_concurrency: int) -> httpx.Limits:
    """One keep-alive connection per concurrent stream, so no stream waits for a connection
    and no TCP handshake lands inside a TTFT (httpx's default caps connections at 100).

    Idle connections are dropped after 4 s, before uvicorn's default 5 s keep-alive timeout
    (SGLang's and vLLM's servers run on uvicorn). A request sent on a connection the server
    is closing at that moment, and answered with no byte at all, is sent once more on a
    fresh connection (`TargetClient.send`); nothing else is retried (a retry could hide what
    the target did).
    """
    return httpx.Limits(
        max_connections=max_concurrency,
        max_keepalive_connections=max_concurrency,
        keepalive_expiry=4.0,
    )


def make_http_client(
    *,
    max_concurrency: int = 64,
    timeout: httpx.Timeout | None = None,
    backend: Backend = DEFAULT_BACKEND,
) -> httpx.AsyncClient:
    """The production `httpx.AsyncClient` for `TargetClient` (the caller closes it)."""
    assert backend in BACKENDS, backend
    limits = default_limits(max_concurrency)
    transport: httpx.AsyncBaseTransport
    if backend == "aiohttp":
        transport = _AiohttpTransport(limits)
    else:
        transport = httpx.AsyncHTTPTransport(limits=limits, verify=ssl_context())
    return HttpClient(transport, timeout=timeout or default_timeout())


class HttpClient(httpx.AsyncClient):
    """An `httpx.AsyncClient` on one transport, which it names (`direct`) when nothing in
    the environment routes requests elsewhere (a proxy)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, *, timeout: httpx.Timeout) -> None:
        super().__init__(transport=transport, timeout=timeout, follow_redirects=False)
        self.direct: httpx.AsyncBaseTransport | None = None if _env_proxies() else transport
        """The transport every request goes to, if `send` would pick it for every URL."""


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once: loading the CA bundle costs ~10 ms of CPU,
    which a fresh client per keep-alive retry would pay each time."""
    return httpx.create_ssl_context()


def _env_proxies() -> bool:
    return any(scheme in ("http", "https", "all") for scheme in urllib.request.getproxies())


class _AiohttpTransport(AiohttpTransport):
    """httpx-aiohttp's transport with the keep-alive trace and the disconnect mapping."""

    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(limits=limits, client=self._session, verify=ssl_context())
        self._max_connections = limits.max_connections or 0
        self._keepalive_s = limits.keepalive_expiry

    def _session(self) -> aiohttp.ClientSession:
        # built on first use, inside the event loop that will drive it
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            keepalive_timeout=self._keepalive_s,
            ssl=self.ssl_context,
        )
        return aiohttp.ClientSession(
            connector=connector,
            trace_configs=[aiohttp_trace_config()],
            read_bufsize=_READ_BUFFER_BYTES,
            auto_decompress=False,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.HTTPError as exc:
            cause = exc.__cause__
            if isinstance(cause, aiohttp.ClientOSError) and _UNWRITABLE in str(cause):
                # the server had closed the connection before the request was written: it
                # sent nothing (httpx-aiohttp would call this a connect timeout)
                message = "Server disconnected without sending a response."
                raise httpx.RemoteProtocolError(message, request=request) from cause
            if not isinstance(cause, aiohttp.ServerDisconnectedError):
                raise
            # aiohttp's default message means not one byte of a response was parsed;
            # anything else carries what was (a partial status line)
            if cause.message == "Server disconnected":
                message = "Server disconnected without sending a response."
            else:
                message = "Server disconnected in the middle of the response head."
            raise httpx.RemoteProtocolError(message, request=request) from cause
