"""Server-sent events framing, and a streaming response that reports client disconnects.

Framing follows OpenAI: each event is `data: <json>\\n\\n` and a stream ends with
`data: [DONE]\\n\\n`. `DisconnectAwareStream` is a Starlette response that watches
`receive()` for `http.disconnect` while it streams and, if the stream ends before its last
chunk (the client left, or producing a chunk failed), stops and awaits `on_incomplete`
(shielded from the cancellation that stopped it). That callback is how an abort reaches
the engine; Starlette's own `StreamingResponse` only cancels its iterator and gives no hook.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_event(data: Mapping[str, Any]) -> bytes:
    """One `data:` event carrying a JSON object."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _no_op() -> None:
    return None


class DisconnectAwareStream(Response):
    """Stream `chunks`; if the stream does not complete, await `on_incomplete`."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        *,
        on_incomplete: Callable[[], Awaitable[None]] = _no_op,
        status_code: int = 200,
        media_type: str = SSE_MEDIA_TYPE,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self.on_incomplete = on_incomplete
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        merged = dict(_SSE_HEADERS) if media_type == SSE_MEDIA_TYPE else {}
        merged.update(headers or {})
        self.init_headers(merged)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = disconnected = False
        try:
            async with anyio.create_task_group() as tasks:

                async def watch_for_disconnect() -> None:
                    nonlocal disconnected
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    disconnected = True
                    tasks.cancel_scope.cancel()

                tasks.start_soon(watch_for_disconnect)
                try:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": self.status_code,
                            "headers": self.raw_headers,
                        }
                    )
                    async for chunk in self.chunks:
                        # a producer that never blocks is never cancelled: check each chunk
                        if disconnected:
                            break
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    else:
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        completed = True
                except OSError:  # the server noticed the closed socket first
                    pass
                tasks.cancel_scope.cancel()
        finally:
            aclose = getattr(self.chunks, "aclose", None)
            with anyio.CancelScope(shield=True):
                if aclose is not None:
                    await aclose()
                if not completed:
                    await self.on_incomplete()
