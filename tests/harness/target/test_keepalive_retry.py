"""The client's one retry: a request that failed on a reused keep-alive connection before any
byte of the answer is sent again on a fresh connection, and the observation says so; a
request that received bytes, or failed on a new connection, is never retried.

The server is a raw asyncio TCP server on a loopback port, so when a connection closes, and
after how many bytes, is exactly what the test says (llama.cpp's race is the first case).
Every case runs on both client backends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx

from kvcanary.harness.record.events import ObservationRecorded, from_record, to_record
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import Backend
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

TENANT = Tenant(name="tenant-0")
BODY = json.dumps(
    {
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: "
    + str(len(BODY)).encode()
    + b"\r\nkeep-alive: timeout=5, max=100\r\n\r\n"
    + BODY
)


@dataclass
class RawServer:
    """Answers request number `n` on each connection as `replies[n]` says: `answer`, `close`
    (no byte), or bytes to send before closing."""

    replies: list[str | bytes]
    num_connections: int = 0
    num_requests: int = 0
    url: str = ""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            for reply in self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.num_requests += 1
                if reply == "answer":
                    writer.write(ANSWER)
                    await writer.drain()
                    continue
                if isinstance(reply, bytes):
                    writer.write(reply)
                    await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def raw_server(*replies: str | bytes) -> AsyncIterator[RawServer]:
    server = RawServer(list(replies))
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        listener.close()
        await listener.wait_closed()


def plan(number: int) -> RequestPlan:
    return RequestPlan(
        request_id=f"t0-r{number:06d}",
        tenant=TENANT.name,
        phase="fill",
        intent="victim",
        size_label="fill",
        num_prompt_tokens=3,
        expected="accept",
        api="completions",
        prompt=" one two three",
        max_tokens=1,
    )


async def two_requests(
    server: RawServer, backend: Backend
) -> tuple[list[Observation], httpx.AsyncClient]:
    http = make_http_client(max_concurrency=1, backend=backend)
    client = TargetClient(http, server.url, model="m", stream=False)
    first = await client.send(plan(1), TENANT, t_scheduled_ns=0)
    second = await client.send(plan(2), TENANT, t_scheduled_ns=0)
    return [first, second], http


async def test_a_reused_connection_closed_without_a_byte_is_retried_once_on_a_fresh_one(
    backend: Backend,
) -> None:
    # each connection answers its first request and closes silently on the second
    async with raw_server("answer", "close") as server:
        (first, second), http = await two_requests(server, backend)
        await http.aclose()
    assert first.ok
    assert first.retry is None
    assert second.ok, second.error
    assert second.retry is not None
    assert "Server disconnected without sending a response" in second.retry
    assert server.num_connections == 2  # the retry opened its own
    assert server.num_requests == 3
    record = to_record(ObservationRecorded(second))
    assert record["retry"] == second.retry  # journaled with the observation
    assert from_record(record) == ObservationRecorded(second)


async def test_a_request_that_received_bytes_is_never_retried(backend: Backend) -> None:
    # a partial status line, then the close: httpx says the same words, but bytes came
    async with raw_server("answer", b"HTTP/1.1 20") as server:
        (first, second), http = await two_requests(server, backend)
        await http.aclose()
    assert first.ok
    assert second.retry is None
    assert second.error_kind is not None
    assert server.num_requests == 2
    assert server.num_connections == 1


async def test_a_fresh_connection_closed_without_a_byte_is_not_retried(backend: Backend) -> None:
    async with raw_server("close") as server:
        http = make_http_client(max_concurrency=1, backend=backend)
        client = TargetClient(http, server.url, model="m", stream=False)
        obs = await client.send(plan(1), TENANT, t_scheduled_ns=0)
        await http.aclose()
    assert obs.retry is None
    assert obs.error_kind == "protocol"
    assert "without sending a response" in (obs.error or "")
    assert (server.num_connections, server.num_requests) == (1, 1)


async def test_a_retry_that_fails_too_is_reported_as_its_failure(backend: Backend) -> None:
    async with raw_server("answer", "close") as server:
        http = make_http_client(max_concurrency=1, backend=backend)
        client = TargetClient(http, server.url, model="m", stream=False)
        assert (await client.send(plan(1), TENANT, t_scheduled_ns=0)).ok
        server.replies = ["close"]  # from now on, new connections close without a byte
        obs = await client.send(plan(2), TENANT, t_scheduled_ns=0)
        await http.aclose()
    assert obs.retry is not None
    assert obs.error_kind == "protocol"
    assert server.num_requests == 3  # the first, the reused attempt, one retry: no more
