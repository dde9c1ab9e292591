"""A prefill/decode proxy in front of two vLLM servers: `python pd_proxy.py PREFILL DECODE`.

vLLM's CPU package ships no PD proxy, so this is the smallest one that does what the
disaggregated deployments do: each completion request is sent to the prefill server first
with `max_tokens=1`, not streamed (the prefill computes the prompt's KV and its
`ExampleConnector` saves it to the shared folder), then the original request goes to the
decode server (whose connector loads that KV) and its answer is relayed as it comes,
streamed or not. A prefill that refuses the request (an over-length prompt's 400) is
relayed instead, and decode is never asked.

Every other route (`/v1/models`, `/tokenize`, `/metrics`, `/health`, ...) goes to decode:
the decode server is the engine whose pool holds the KV the answers are made from (what
was prefilled elsewhere is loaded into it), so its limits, KV pool and prefix-cache counters
are the deployment's as a client sees them; both servers serve the same model, so its
model list and token counts are the same either way.

Prints `listening <url>` once it listens on a free 127.0.0.1 port; stops when stdin closes
(the test that started it closes it), so it never outlives its test.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp
from aiohttp import web

COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("Authorization", "Content-Type", "Accept")
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it: one token, one JSON answer."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


class Proxy:
    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for route in COMPLETION_ROUTES:
            app.router.add_post(route, self.complete)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=_TIMEOUT, auto_decompress=False)

    async def _close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        headers = _headers(request)
        assert self.session is not None
        url = f"{self.prefill}{request.path}"
        async with self.session.post(url, json=prefill_body(body), headers=headers) as prefilled:
            if prefilled.status != 200:
                return await _relay(request, prefilled)
            await prefilled.read()
        async with self.session.post(
            f"{self.decode}{request.path}", data=raw, headers=headers
        ) as decoded:
            return await _relay(request, decoded)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.request(
            request.method,
            f"{self.decode}{request.rel_url}",
            data=await request.read() if request.can_read_body else None,
            headers=_headers(request),
        ) as answer:
            return await _relay(request, answer)


def _headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}


async def _relay(request: web.Request, answer: aiohttp.ClientResponse) -> web.StreamResponse:
    """Relay an upstream answer chunk by chunk (an SSE stream reaches the client as it is
    written; a client that goes away cancels this handler, which closes the upstream)."""
    response = web.StreamResponse(status=answer.status, reason=answer.reason)
    for name in ("Content-Type", "Content-Encoding"):
        if name in answer.headers:
            response.headers[name] = answer.headers[name]
    await response.prepare(request)
    async for chunk in answer.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


async def serve(prefill: str, decode: str) -> None:
    runner = web.AppRunner(Proxy(prefill, decode).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening http://127.0.0.1:{port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
