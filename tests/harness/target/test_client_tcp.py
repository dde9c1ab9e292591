"""TargetClient over real loopback TCP on each client backend: the transport failures a
handler cannot stage in-process (test_client.py), what the production client does and does
not carry from one request to the next, and when it bypasses `AsyncClient.send`."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import handler_server
import httpx
import pytest

from kvcanary.harness.record.observation import Observation
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import Backend, HttpClient
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

TENANT = Tenant(name="tenant-0")


def make_plan(tenant: str = "tenant-0") -> RequestPlan:
    return RequestPlan(
        request_id="t0-r000001",
        tenant=tenant,
        phase="fill",
        intent="victim",
        size_label="1",
        num_prompt_tokens=3,
        expected="accept",
        api="chat",
        prompt="hello canary world",
        max_tokens=4,
    )


async def observe(
    url: str, backend: Backend, read_s: float = 5.0, tenant: Tenant = TENANT
) -> Observation:
    timeout = httpx.Timeout(5.0, read=read_s)
    async with make_http_client(timeout=timeout, backend=backend) as http:
        client = TargetClient(http, url, model="m", deadline_s=10.0)
        return await client.send(
            make_plan(tenant.name), tenant, t_scheduled_ns=time.perf_counter_ns()
        )


class RawServer:
    """Accepts connections, reads each request head, then does `behaviour` to it."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.num_requests = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        self.num_requests += 1
        if self.behaviour == "hang_up":
            writer.close()
        # "silent": keep the connection open and never answer

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


@pytest.fixture
def closed_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]  # bound, never listening: connections are refused


async def test_a_refused_connection_is_a_connect_error(closed_port: int, backend: Backend) -> None:
    observation = await observe(f"http://127.0.0.1:{closed_port}", backend)
    assert observation.error_kind == "connect", observation.error
    assert observation.status is None
    assert observation.t_first_byte_ns is None
    assert observation.retry is None


@pytest.mark.parametrize(("behaviour", "kind"), [("silent", "timeout"), ("hang_up", "protocol")])
async def test_a_server_that_never_answers(behaviour: str, kind: str, backend: Backend) -> None:
    """Silent: the read timeout ends it. Hung up on a fresh connection without a byte: a
    protocol error, not retried (only a reused keep-alive connection is)."""
    raw = RawServer(behaviour)
    server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        observation = await observe(f"http://127.0.0.1:{port}", backend, read_s=0.5)
    finally:
        raw.close()
        server.close()
        await server.wait_closed()
    assert observation.error_kind == kind, observation.error
    assert observation.status is None
    assert observation.retry is None
    assert raw.num_requests == 1


def answer(request: httpx.Request) -> httpx.Response:
    body = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}'
        b"\n\ndata: [DONE]\n\n"
    )
    headers = {"content-type": "text/event-stream", "set-cookie": "affinity=tenant-0; Path=/"}
    return httpx.Response(200, headers=headers, content=body)


async def test_no_cookie_rides_from_one_tenants_response_to_the_next_request(
    backend: Backend,
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(request)

    with handler_server.serve() as server:
        server.handler = handler
        async with make_http_client(backend=backend) as http:
            client = TargetClient(http, server.url, model="m")
            for tenant in (TENANT, Tenant(name="tenant-1")):
                observation = await client.send(
                    make_plan(tenant.name), tenant, t_scheduled_ns=time.perf_counter_ns()
                )
                assert observation.ok, observation.error
    assert len(seen) == 2
    assert "cookie" not in seen[1].headers
    assert seen[1].headers["accept"] == "text/event-stream"
    assert seen[1].headers["user-agent"].startswith("python-httpx/")  # the client's defaults


def test_the_production_client_names_its_transport_unless_a_proxy_is_set(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    direct = make_http_client(backend=backend)
    assert isinstance(direct, HttpClient)
    assert direct.direct is not None
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    proxied = make_http_client(backend=backend)
    assert isinstance(proxied, HttpClient)
    assert proxied.direct is None  # every request goes through `send`, which routes it
