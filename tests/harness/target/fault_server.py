"""A hostile OpenAI-compatible server: the fault kinds `misbehaving_server` lacks, for the
fault-injection test, served over real TCP with `misbehaving_server.serve`.

The first path segment picks the fault, as in `misbehaving_server`, whose app answers every
fault this one does not know. Completion faults answer `/<fault>/v1/(chat/)completions`;
discovery faults answer the introspection paths (`/<fault>/v1/models`, `/get_server_info`,
`/metrics`, ...) and 404 everything else. Endless bodies stop when the client goes away, so a
client that cuts a response early also stops the server's work.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import misbehaving_server as base
from misbehaving_server import Receive, Scope, Send, Stream

BOMB_PIECE = 1024 * 1024
BOMB_PIECES = 4096
"""A bomb inflates to 4 GiB unless the client stops reading (it sends a few MiB of gzip)."""
HUGE_BODY_PIECES = 1600
"""128 KiB pieces: a 200 MB body."""
DEEP = 10**5


def _choice(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}


def _usage(value: Any) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": value, "completion_tokens": 1}}


USAGE_FAULTS: dict[str, Any] = {
    "usage_huge": 10**30,
    "usage_negative": -5,
    "usage_float": 3.5,
    "usage_string": "3",
    "usage_list": [3],
}


async def _bomb(
    coding: str, line_prefix: bytes, gone: asyncio.Future[None]
) -> AsyncIterator[bytes]:
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[coding]
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    yield packer.compress(line_prefix)
    zeros = b"0" * BOMB_PIECE
    for _ in range(BOMB_PIECES):
        if gone.done():
            return
        yield packer.compress(zeros) + packer.flush(zlib.Z_SYNC_FLUSH)
        await asyncio.sleep(0)
    yield packer.flush()


async def _completion_fault(
    fault: str, out: Stream, send: Send, gone: asyncio.Future[None]
) -> None:
    """Serve `fault` (one of `COMPLETION_FAULTS`) for a completion request."""
    if fault == "surrogate":  # a lone surrogate escape in the text, then a clean end
        await out.start()
        await out.raw(b'data: {"choices": [{"index": 0, "delta": {"content": "a\\ud800b"}}]}\n\n')
        await out.event({"choices": [_choice("c", "stop")]})
        await out.end(b"data: [DONE]\n\n")
    elif fault in USAGE_FAULTS:
        await out.start()
        await out.event({"choices": [_choice("word0 ", "stop")]})
        await out.event(_usage(USAGE_FAULTS[fault]))
        await out.end(b"data: [DONE]\n\n")
    elif fault == "deep_json":  # 10**5 levels of nesting inside a chunk
        await out.start()
        await out.event({"choices": [_choice("word0 ")]})
        await out.raw(b'data: {"choices": [], "x": ' + b"[" * DEEP + b"]" * DEEP + b"}\n\n")
        await out.end(b"data: [DONE]\n\n")
    elif fault in ("gzip_bomb", "deflate_bomb"):
        coding = fault.removesuffix("_bomb")
        headers = [(b"content-type", b"text/event-stream"), (b"content-encoding", coding.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for piece in _bomb(coding, b'data: {"choices": [{"text": "', gone):
            await out.raw(piece)
        await out.end()
    elif fault == "gzip_ok":  # compressed although identity was asked for: still readable
        headers = [(b"content-type", b"text/event-stream"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = b"".join(
            b"data: " + json.dumps({"choices": [_choice(base.chunk_text(i))]}).encode() + b"\n\n"
            for i in range(3)
        )
        events += b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
        await out.end(zlib.compress(events + b"data: [DONE]\n\n", wbits=16 + zlib.MAX_WBITS))
    elif fault == "body_200mb":  # one event that never ends its line, 200 MB of it
        await out.start()
        await out.raw(b'data: {"choices": [{"text": "')
        piece = b"x" * base.HUGE_PIECE
        for _ in range(HUGE_BODY_PIECES):
            if gone.done():
                return
            await out.raw(piece)
        await out.end()
    elif fault == "trickle_1bps":  # one byte a second, for as long as the client stays
        await out.start()
        for byte in b'data: {"choices": [{"index": 0, "delta": {"content": "slow"}}]}\n\n' * 10:
            if gone.done():
                return
            await out.raw(bytes([byte]))
            await asyncio.sleep(1.0)
        await out.end()
    elif fault == "cr_lines":  # legal SSE with bare CR line ends
        await out.start()
        for i in range(2):
            data = json.dumps({"choices": [_choice(base.chunk_text(i), "stop" if i else None)]})
            await out.raw(b"data: " + data.encode() + b"\r\r")
        await out.end(b"data: [DONE]\r\r")
    elif fault == "missing_done":  # content, then the body ends: no [DONE], no finish_reason
        await out.start()
        await out.event({"choices": [_choice("word0 ")]})
        await out.end()
    elif fault in ("status_429", "status_429_retry_after", "status_503_retry_after"):
        status = int(fault.split("_")[1])
        headers = [(b"content-type", b"application/json")]
        if fault.endswith("retry_after"):
            headers.append((b"retry-after", b"3"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await out.end(b'{"error": {"message": "on purpose: slow down"}}')
    elif fault == "status_500_gzip":  # a compressed error body, still quoted readably
        headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 500, "headers": headers})
        body = b'{"error": {"message": "on purpose: compressed"}}'
        await out.end(zlib.compress(body, wbits=16 + zlib.MAX_WBITS))
    elif fault == "html_500":
        await out.start(500, b"text/html")
        await out.end(b"<html><body>502 Bad Gateway</body></html>")
    elif fault == "redirect":
        headers = [(b"location", b"/ok/v1/chat/completions"), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 307, "headers": headers})
        await out.end()
    else:
        raise AssertionError(f"unknown completion fault {fault!r}")


async def _discovery_fault(
    fault: str, path: str, out: Stream, send: Send, gone: asyncio.Future[None]
) -> None:
    """Serve `fault` for an introspection path: a 404 unless the fault is about this path."""
    if fault == "all_hang":
        await gone
        return
    if fault == "models_hang" and path == "/v1/models":
        await gone
        return
    if fault == "models_huge" and path == "/v1/models":  # 200 MB of model cards
        await out.start(200, b"application/json")
        await out.raw(b'{"data": [')
        card = b'{"id": "m", "object": "model", "max_model_len": 4096},' * 2000
        for _ in range(200 * 1024 * 1024 // len(card)):
            if gone.done():
                return
            await out.raw(card)
        await out.end(b'{"id": "m"}]}')
        return
    if fault == "models_gzip_bomb" and path == "/v1/models":
        headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for piece in _bomb("gzip", b'{"data": [{"id": "', gone):
            await out.raw(piece)
        await out.end()
        return
    if fault == "models_deep" and path == "/v1/models":
        await out.start(200, b"application/json")
        await out.end(b'{"data": ' + b"[" * DEEP + b"]" * DEEP + b"}")
        return
    if fault == "models_surrogate" and path == "/v1/models":
        await out.start(200, b"application/json")
        await out.end(b'{"data": [{"id": "m\\ud800", "max_model_len": 4096}]}')
        return
    if fault == "metrics_huge" and path == "/metrics":
        await out.start(200, b"text/plain")
        line = b"# HELP x y\n" * 10000
        for _ in range(200 * 1024 * 1024 // len(line)):
            if gone.done():
                return
            await out.raw(line)
        await out.end()
        return
    await out.start(404, b"application/json")
    await out.end(b'{"error": {"message": "not here"}}')


DISCOVERY_FAULTS = (
    "all_hang",
    "models_hang",
    "models_huge",
    "models_gzip_bomb",
    "models_deep",
    "models_surrogate",
    "metrics_huge",
)


COMPLETION_FAULTS = (
    "surrogate",
    *USAGE_FAULTS,
    "deep_json",
    "gzip_bomb",
    "deflate_bomb",
    "gzip_ok",
    "body_200mb",
    "trickle_1bps",
    "cr_lines",
    "missing_done",
    "status_429",
    "status_429_retry_after",
    "status_503_retry_after",
    "status_500_gzip",
    "html_500",
    "redirect",
)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI entry point: this module's faults, else `misbehaving_server.app`'s."""
    segments = scope["path"].strip("/").split("/")
    fault, path = segments[0], "/" + "/".join(segments[1:])
    if fault not in DISCOVERY_FAULTS and fault not in COMPLETION_FAULTS:
        await base.app(scope, receive, send)
        return
    while (await receive()).get("more_body"):
        pass  # the request body is not needed
    gone: asyncio.Future[None] = asyncio.ensure_future(_disconnected(receive))
    try:
        out = Stream(send, "chat" if path.endswith("/chat/completions") else "completions")
        if fault in DISCOVERY_FAULTS:
            await _discovery_fault(fault, path, out, send, gone)
        else:
            await _completion_fault(fault, out, send, gone)
    finally:
        gone.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
