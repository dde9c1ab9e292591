"""An httpx handler, the function `httpx.MockTransport` takes, served over real loopback TCP.

`serve()` runs uvicorn on a free 127.0.0.1 port (`misbehaving_server.serve`) with an app that
turns each request into an `httpx.Request` (method, URL, headers, body as received), calls
the current handler with it, and writes the `httpx.Response` it returns: status, headers and
the body stream piece by piece, each piece one write, pauses in the stream kept. So the same
test runs in-process and over TCP on either client backend.

What the client sees when the stream fails is what a real server would make it see: a
stream that raises an `httpx.TimeoutException` stalls (the connection stays open, silent,
until the client gives up), any other exception aborts the connection mid-body. When the
client goes away, the stream's iteration is cancelled; it is closed (`aclose`) however the
response ended, as `httpx` closes it in-process. The handler runs in the server's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import misbehaving_server
from misbehaving_server import Receive, Scope, Send

Handler = Callable[[httpx.Request], Any]


class HandlerServer:
    """A loopback server answering with whatever `handler` currently returns."""

    def __init__(self) -> None:
        self.handler: Handler | None = None
        self.url = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await misbehaving_server.read_body(receive)
        query = scope.get("query_string", b"").decode()
        url = f"{self.url}{scope['path']}" + (f"?{query}" if query else "")
        request = httpx.Request(scope["method"], url, headers=list(scope["headers"]), content=body)
        assert self.handler is not None, "no handler set"
        response = self.handler(request)
        assert isinstance(response, httpx.Response), type(response)
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream), type(stream)
        writer = asyncio.ensure_future(_write(response, stream, send))
        watcher = asyncio.ensure_future(_until_gone(receive))
        try:
            await asyncio.wait([writer, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():  # the client went away: stop serving it
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                return
            failure = writer.exception()
            if isinstance(failure, httpx.TimeoutException):
                await watcher  # stall until the client gives up
            elif failure is not None:
                raise failure  # uvicorn aborts the connection mid-body
        finally:
            watcher.cancel()
            await stream.aclose()


async def _write(response: httpx.Response, stream: httpx.AsyncByteStream, send: Send) -> None:
    headers = [(name.lower(), value) for name, value in response.headers.raw]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    async for piece in stream:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@contextlib.contextmanager
def serve() -> Iterator[HandlerServer]:
    """A running `HandlerServer` (set its `handler` before each request)."""
    app = HandlerServer()
    with misbehaving_server.serve(app) as url:
        app.url = url
        yield app
