"""A small OpenAI-compatible server that misbehaves on request, for the target client's tests.

A raw ASGI app, so every byte and every pause is under the test's control. The first path
segment picks the behaviour, so a base URL such as `http://127.0.0.1:PORT/truncated` points
a `TargetClient` at one misbehaviour. `max_tokens` in the request sets how many content
chunks well-behaved streams send. Every content chunk carries `server_t_ns`, the server's
`perf_counter_ns` just before the chunk was written (same clock as the client's on one host).

Runs under `httpx.ASGITransport` (which buffers whole bodies) or under uvicorn on a loopback
port with `serve()` (which streams for real, needed for hangs, resets and timing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HUGE_PIECE = 128 * 1024
HUGE_PIECES = 64  # 8 MiB: finite, so ASGITransport (which buffers) still terminates
PACED_DELAY_S = 0.3
TRICKLE_DELAY_S = 0.05

PACES = ("ok", "paced", "trickle")
"""Well-formed streams: at once, `PACED_DELAY_S` or `TRICKLE_DELAY_S` before each chunk."""
FAULTS = (
    "ok",
    "malformed",
    "truncated",
    "reset",
    "status_500",
    "status_400",
    "hang",
    "hang_mid_stream",
    "huge",
    "huge_line",
    "error_after_200",
    "error_event",
    "not_sse",
    "keepalive",
)
"""Every fault `app` serves (`ok` the well-formed answer; any other first path segment
than these and `PACES` is answered with a 404)."""

CLIENT_PORTS: list[int] = []
"""Client ports of well-formed requests, in arrival order (shows connection reuse)."""
WRITE_STAMPS: dict[str, list[int]] = {}
"""Server write stamps of each well-formed stream's content chunks, keyed by its prompt."""
DISCONNECTS: list[str] = []
"""Behaviours whose client went away while the server was still waiting on it."""


class Stream:
    """Writes one SSE response and stamps each content chunk."""

    def __init__(self, send: Send, api: str, stamps: list[int] | None = None) -> None:
        self._send = send
        self._api = api
        self._stamps = stamps if stamps is not None else []

    async def start(self, status: int = 200, content_type: bytes = b"text/event-stream") -> None:
        headers = [(b"content-type", content_type), (b"cache-control", b"no-store")]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def raw(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def event(self, obj: Any) -> None:
        await self.raw(b"data: " + json.dumps(obj).encode() + b"\n\n")

    async def role(self) -> None:
        if self._api == "chat":  # vLLM and SGLang open chat streams with a role-only chunk
            await self.event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})

    async def content(self, text: str, finish_reason: str | None = None) -> None:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self._api == "chat":
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        t_ns = time.perf_counter_ns()
        self._stamps.append(t_ns)
        await self.event({"choices": [choice], "server_t_ns": t_ns})

    async def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        await self.event({"choices": [], "usage": usage})


def chunk_text(i: int) -> str:
    return f"word{i} "


async def _well_formed(
    out: Stream, request: dict[str, Any], delay_s: float, receive: Receive
) -> None:
    num_chunks = int(request.get("max_tokens", 4))
    await out.start()
    await out.role()
    # a paced stream stops when its client leaves (uvicorn drops writes to a closed socket)
    gone = asyncio.ensure_future(_wait_for_disconnect(receive, "well_formed"))
    try:
        for i in range(num_chunks):
            await asyncio.sleep(delay_s)
            if gone.done():
                return
            await out.content(chunk_text(i), "length" if i == num_chunks - 1 else None)
        await out.usage(_prompt_tokens(request), num_chunks)
        await out.end(b"data: [DONE]\n\n")
    finally:
        gone.cancel()


def _prompt(request: dict[str, Any]) -> str:
    return str(request.get("prompt") or request["messages"][-1]["content"])


def _prompt_tokens(request: dict[str, Any]) -> int:
    return len(_prompt(request).split())


async def _wait_for_disconnect(receive: Receive, behaviour: str) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    DISCONNECTS.append(behaviour)


async def _behave(behaviour: str, out: Stream, request: dict[str, Any], receive: Receive) -> None:
    if behaviour in PACES:
        delay = {"ok": 0.0, "paced": PACED_DELAY_S, "trickle": TRICKLE_DELAY_S}[behaviour]
        await _well_formed(out, request, delay, receive)
    elif behaviour == "malformed":
        await out.start()
        await out.content(chunk_text(0))
        await out.end(b'data: {"choices": [{"delta": {"content": "x"\n\ndata: [DONE]\n\n')
    elif behaviour == "truncated":
        await out.start()
        await out.role()
        await out.content(chunk_text(0))
        await out.content(chunk_text(1))
        await out.end()
    elif behaviour == "reset":
        await out.start()
        await out.content(chunk_text(0))
        raise RuntimeError("connection reset on purpose")  # uvicorn aborts the chunked body
    elif behaviour in ("status_500", "status_400"):
        status = int(behaviour.removeprefix("status_"))
        body = {"error": {"message": f"on purpose: prompt too long ({status})", "code": status}}
        await out.start(status, b"application/json")
        await out.end(json.dumps(body).encode())
    elif behaviour == "hang":
        await _wait_for_disconnect(receive, behaviour)
    elif behaviour == "hang_mid_stream":
        await out.start()
        await out.content(chunk_text(0))
        await _wait_for_disconnect(receive, behaviour)
    elif behaviour == "huge":
        await out.start()
        for _ in range(HUGE_PIECES):
            await out.content("x" * HUGE_PIECE)
        await out.end(b"data: [DONE]\n\n")
    elif behaviour == "huge_line":  # one event that never ends its line
        await out.start()
        await out.raw(b'data: {"choices": [{"text": "')
        for _ in range(HUGE_PIECES):
            await out.raw(b"x" * HUGE_PIECE)
        await out.end()
    elif behaviour in ("error_after_200", "error_event"):
        await out.start()
        await out.content(chunk_text(0))
        error = json.dumps({"error": {"message": "on purpose: internal error", "code": 500}})
        prefix = b"data: " if behaviour == "error_after_200" else b"event: error\ndata: "
        await out.end(prefix + error.encode() + b"\n\n")
    elif behaviour == "not_sse":
        await out.start(200, b"text/html")
        await out.end(b"<html>proxy error page</html>")
    elif behaviour == "keepalive":  # legal but awkward SSE: comments, CRLF, no space after colon
        await out.start()
        await out.raw(b": ping\r\n\r\n")
        first = json.dumps({"choices": [{"index": 0, "text": chunk_text(0), "delta": None}]})
        await out.raw(b"data:" + first.encode() + b"\r\n\r\n: ping\n\n")
        await out.content(chunk_text(1), "stop")
        await out.end(b"data: [DONE]\n\n")
    else:
        await out.start(404, b"application/json")
        await out.end(b'{"error": {"message": "no such behaviour"}}')


async def _json_answer(send: Send, request: dict[str, Any], api: str) -> None:
    num_tokens = int(request.get("max_tokens", 4))
    text = "".join(chunk_text(i) for i in range(num_tokens))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice.update(
        {"message": {"role": "assistant", "content": text}} if api == "chat" else {"text": text}
    )
    body = {
        "choices": [choice],
        "usage": {"prompt_tokens": _prompt_tokens(request), "completion_tokens": num_tokens},
    }
    out = Stream(send, api)
    await out.start(200, b"application/json")
    await out.end(json.dumps(body).encode())


async def read_body(receive: Receive) -> bytes:
    """A request's whole body, however many messages it came in."""
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI entry point: `/<behaviour>/v1/(chat/)completions`."""
    assert scope["type"] == "http", "run with lifespan off"
    body = await read_body(receive)
    request = json.loads(body or b"{}")
    behaviour = scope["path"].strip("/").split("/")[0]
    api = "chat" if scope["path"].endswith("/chat/completions") else "completions"
    if behaviour in ("ok", "paced", "trickle") and scope.get("client"):
        CLIENT_PORTS.append(scope["client"][1])
    if behaviour == "ok" and not request.get("stream"):
        await _json_answer(send, request, api)
        return
    stamps = WRITE_STAMPS.setdefault(_prompt(request), []) if request else None
    await _behave(behaviour, Stream(send, api, stamps), request, receive)


@contextlib.contextmanager
def serve(asgi_app: Any = app) -> Iterator[str]:
    """Run `asgi_app` under uvicorn on a free loopback port in a thread; yield its root URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        asgi_app, lifespan="off", log_level="critical", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
