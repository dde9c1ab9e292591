"""The production HTTP client for `harness.target.client.TargetClient`: explicit limits and
timeouts sized for long prompts and many concurrent streams.

With `backend="aiohttp"` httpcore's connection trace does not run, so the keep-alive retry
(`harness.target.keepalive`) never fires there: such a request fails as it did.
"""

from __future__ import annotations

from typing import Literal

import httpx

from canaries.errors import ConfigError


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
    backend: Literal["httpx", "aiohttp"] = "httpx",
) -> httpx.AsyncClient:
    """The production `httpx.AsyncClient` for `TargetClient` (the caller closes it).

    `backend="aiohttp"` keeps the httpx API but does the I/O with aiohttp (the optional
    `httpx-aiohttp` package): httpcore's connection pool costs CPU per request that grows
    with the number of open connections, which at hundreds of concurrent streams inflates
    measured TTFTs by tens of milliseconds (benchmarks/RESULTS-client.md).
    """
    limits = default_limits(max_concurrency)
    transport: httpx.AsyncBaseTransport | None = None
    if backend == "aiohttp":
        try:
            from httpx_aiohttp import AiohttpTransport
        except ImportError:
            raise ConfigError(
                "the aiohttp HTTP backend needs the httpx-aiohttp package (pip install "
                "httpx-aiohttp)"
            ) from None
        transport = AiohttpTransport(limits=limits)
    return httpx.AsyncClient(
        limits=limits,
        timeout=timeout or default_timeout(),
        follow_redirects=False,
        transport=transport,
    )
