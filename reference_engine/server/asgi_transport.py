"""An httpx transport that calls an in-process ASGI app and streams its response.

httpx's own `ASGITransport` runs the app to completion and buffers the body, which hides
time-to-first-token and makes a client disconnect impossible to express. This transport
returns the response as soon as the app sends `http.response.start`, yields body chunks as
the app sends them, and closing the response tells the app the client went away
(`http.disconnect`), exactly as a closed socket would under uvicorn. It speaks ASGI spec
2.3: sends after a disconnect are ignored, the app learns of it through `receive()`.

It knows nothing about the engine; the in-process router uses it to reach the side apps,
and tests use it to reach any app without a socket. It does not run lifespan events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[Message]],
        Callable[[Message], Awaitable[None]],
    ],
    Awaitable[None],
]

_APP_EXIT_GRACE_S = 5.0
"""How long a closed response waits for the app to notice the disconnect before cancelling it."""


class _Exchange:
    """One request/response between the client and the app task."""

    def __init__(self, request: httpx.Request) -> None:
        self.request_chunks = request.stream.__aiter__()  # type: ignore[union-attr]
        self.request_done = False
        self.started: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.body: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.disconnected = asyncio.Event()
        self.complete = False

    async def receive(self) -> Message:
        if not self.request_done:
            try:
                chunk = await self.request_chunks.__anext__()
            except StopAsyncIteration:
                self.request_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": bytes(chunk), "more_body": True}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.disconnected.is_set():
            return
        if message["type"] == "http.response.start":
            assert not self.started.done(), "response started twice"
            self.started.set_result(message)
        elif message["type"] == "http.response.body":
            assert self.started.done(), "body before the response start"
            assert not self.complete, "body after the response ended"
            body = message.get("body", b"")
            if body:
                self.body.put_nowait(bytes(body))
            if not message.get("more_body", False):
                self.complete = True
                self.body.put_nowait(None)


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, exchange: _Exchange, app_task: asyncio.Task[None]) -> None:
        self._exchange = exchange
        self._app_task = app_task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        body = self._exchange.body
        while True:
            if body.empty():
                if self._app_task.done():
                    self._app_task.result()  # the app's own error, if it had one
                    raise httpx.RemoteProtocolError("app ended without completing its response")
                getter = asyncio.ensure_future(body.get())
                try:
                    await asyncio.wait(
                        {getter, self._app_task}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    if not getter.done():
                        getter.cancel()
                if not getter.done() or getter.cancelled():
                    continue
                chunk = getter.result()
            else:
                chunk = body.get_nowait()
            if chunk is None:
                return
            yield chunk

    async def aclose(self) -> None:
        await _disconnect(self._exchange, self._app_task)


async def _disconnect(exchange: _Exchange, app_task: asyncio.Task[None]) -> None:
    """Tell the app the client left; give it a grace period to finish, then cancel it."""
    exchange.disconnected.set()
    if app_task.done():
        return
    try:
        await asyncio.wait_for(asyncio.shield(app_task), _APP_EXIT_GRACE_S)
    except TimeoutError:
        app_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await app_task
    except Exception:  # the app's own failure after the client left is not ours to raise
        pass


_reapers: set[asyncio.Task[None]] = set()


def _reap_later(exchange: _Exchange, app_task: asyncio.Task[None]) -> None:
    reaper = asyncio.ensure_future(_disconnect(exchange, app_task))
    _reapers.add(reaper)
    reaper.add_done_callback(_reapers.discard)


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Send httpx requests to an ASGI app in this event loop, streaming the response."""

    def __init__(self, app: ASGIApp, *, client: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.app = app
        self.client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port),
            "client": self.client,
            "root_path": "",
        }
        exchange = _Exchange(request)
        app_task = asyncio.ensure_future(self.app(scope, exchange.receive, exchange.send))
        try:
            pending: set[asyncio.Future[Any]] = {exchange.started, app_task}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller gave up: the app sees a disconnect
            _reap_later(exchange, app_task)
            raise
        if not exchange.started.done():
            app_task.result()  # raises the app's exception
            raise httpx.RemoteProtocolError("app returned without sending a response")
        start = exchange.started.result()
        return httpx.Response(
            start["status"],
            headers=start.get("headers", []),
            stream=_ResponseStream(exchange, app_task),
        )
