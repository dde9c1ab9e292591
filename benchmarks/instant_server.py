"""An OpenAI-compatible SSE server that answers at once: the floor every load generator is
measured against (`bench_run.py`, `bench_soak.py`).

A raw asyncio HTTP/1.1 server, so that as little of the shared CPU as possible goes to the
server: `GET /v1/models` names one model (`instant`, with its context length), `GET /health` is
200, `POST
/v1/completions` and `/v1/chat/completions` stream `max_tokens` chunks of one word each,
then a usage chunk (`completion_tokens` only: the server does not tokenize prompts, so it
claims no prompt count) and `[DONE]`, in one chunked response written in one go. Anything
else is a 404. Keep-alive, pipelining-safe (one request at a time per connection).

    python benchmarks/instant_server.py --port 8123 [--context 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

MODEL = "instant"
_WORD = " ok"


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _stream(request: dict[str, object], chat: bool) -> bytes:
    raw = request.get("max_tokens") or request.get("max_completion_tokens") or 16
    num_chunks = max(1, int(raw))  # type: ignore[call-overload]
    head = f'data: {{"id":"c","object":"text_completion","model":"{MODEL}","choices":[{{"index":0,'
    if chat:
        body = head + '"delta":{"content":"' + _WORD + '"},"finish_reason":null}]}\n\n'
        last = head + '"delta":{"content":"' + _WORD + '"},"finish_reason":"length"}]}\n\n'
    else:
        body = head + '"text":"' + _WORD + '","finish_reason":null}]}\n\n'
        last = head + '"text":"' + _WORD + '","finish_reason":"length"}]}\n\n'
    usage = {"completion_tokens": num_chunks}
    usage_line = "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
    events = body * (num_chunks - 1) + last + usage_line + "data: [DONE]\n\n"
    return _chunked(events.encode()) + b"0\r\n\r\n"


class _Http(asyncio.Protocol):
    def __init__(self, models: bytes) -> None:
        self._models = models
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            self._answer(method, path.split("?")[0], body)

    def _answer(self, method: str, path: str, body: bytes) -> None:
        assert self._transport is not None
        if method == "GET" and path == "/v1/models":
            self._send(200, b"application/json", self._models)
        elif method == "GET" and path == "/health":
            self._send(200, b"application/json", b"{}")
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            request = json.loads(body)
            if not request.get("stream"):
                text = _WORD * int(request.get("max_tokens") or 16)
                answer = {"choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
                self._send(200, b"application/json", json.dumps(answer).encode())
                return
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            self._transport.write(head + _stream(request, path.endswith("chat/completions")))
        else:
            self._send(404, b"application/json", b'{"error":"not found"}')

    def _send(self, status: int, content_type: bytes, payload: bytes) -> None:
        assert self._transport is not None
        reason = b"OK" if status == 200 else b"Not Found"
        self._transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, content_type, len(payload), payload)
        )


async def serve(port: int, context: int) -> None:
    models = json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": context}]}
    ).encode()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Http(models), "127.0.0.1", port, backlog=4096, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(port: int, context: int = 4096) -> subprocess.Popen[bytes]:
    """The server in a subprocess, once it accepts connections."""
    command = [sys.executable, str(Path(__file__)), "--port", str(port), "--context", str(context)]
    return started(command, port)


def started(command: list[str], port: int) -> subprocess.Popen[bytes]:
    """A server started by `command`, once it accepts connections on `port`."""
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("the instant server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.context))


if __name__ == "__main__":
    main()
