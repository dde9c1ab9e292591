"""Recorded engine responses (tests/harness/fixtures/), served two ways from one route table:
through `httpx.MockTransport` for library tests, and by a threaded HTTP server on a free
127.0.0.1 port for black-box CLI tests. Every request served is kept, headers included.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass(frozen=True)
class Seen:
    """One request a recorded target received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Reply = tuple[int, str, bytes]  # status, content type, body
Handler = Callable[[Seen], Reply]


def json_reply(obj: Any, status: int = 200) -> Handler:
    body = json.dumps(obj).encode()
    return lambda _: (status, "application/json", body)


def text_reply(text: str, status: int = 200, content_type: str = "text/plain") -> Handler:
    return lambda _: (status, content_type, text.encode())


def fixture_json(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def sglang_routes() -> dict[str, Handler]:
    return {
        "GET /get_server_info": json_reply(fixture_json("sglang_server_info.json")),
        "GET /v1/models": json_reply(fixture_json("sglang_models.json")),
    }


def mini_lb_routes() -> dict[str, Handler]:
    return {
        "GET /get_server_info": json_reply(fixture_json("sglang_mini_lb_server_info.json")),
        "GET /v1/models": json_reply(fixture_json("sglang_mini_lb_models.json")),
    }


def vllm_routes() -> dict[str, Handler]:
    return {
        "GET /v1/models": json_reply(fixture_json("vllm_models.json")),
        "GET /metrics": text_reply(fixture_text("vllm_metrics.txt")),
    }


@dataclass
class RecordedTarget:
    """A route table keyed `"METHOD /path"`; anything else is a 404 like a real server's."""

    routes: dict[str, Handler]
    seen: list[Seen] = field(default_factory=list)

    def answer(self, seen: Seen) -> Reply:
        self.seen.append(seen)
        handler = self.routes.get(f"{seen.method} {seen.path}")
        if handler is None:
            return 404, "application/json", b'{"detail":"Not Found"}'
        return handler(seen)

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]


def mock_client(hosts: dict[str, RecordedTarget]) -> httpx.AsyncClient:
    """A client whose requests to `http://<host>` are answered by `hosts[host]`."""

    def handle(request: httpx.Request) -> httpx.Response:
        target = hosts.get(request.url.host)
        if target is None:
            raise httpx.ConnectError("connection refused", request=request)
        seen = Seen(request.method, request.url.path, dict(request.headers), request.content)
        status, content_type, body = target.answer(seen)
        return httpx.Response(status, headers={"content-type": content_type}, content=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


@contextmanager
def serving(target: RecordedTarget) -> Iterator[str]:
    """Serve `target` on a free loopback port; yields its base URL."""

    class _Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, content_type, reply = target.answer(
                Seen(self.command, self.path.split("?")[0], headers, body)
            )
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
