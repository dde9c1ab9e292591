"""The streamed JSON body: the same bytes as httpx's `json=`, a known length, re-iterable,
and never more than one chunk of the big string encoded at a time."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import tracemalloc
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.harness.target import json_body
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import Backend
from kvcanary.harness.target.json_body import CHUNK_CHARS, JsonBody
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant


async def pieces_of(body: JsonBody) -> list[bytes]:
    return [piece async for piece in body]


def as_httpx_sends(obj: Any) -> bytes:
    return httpx.Request("POST", "http://x", json=obj).content


# text without lone surrogates (JSON bodies are UTF-8)
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=300)


@settings(max_examples=200, deadline=None)
@given(text=TEXT, other=TEXT, chunk=st.integers(1, 7))
async def test_the_bytes_are_those_of_json_equals(text: str, other: str, chunk: int) -> None:
    chat = {"model": other, "messages": [{"role": "user", "content": text}], "stream": True}
    completions = {"model": "m", "prompt": text, "max_tokens": 3, "extra": other}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json_body, "CHUNK_CHARS", chunk)
        for obj, big in ((chat, ("messages", 0, "content")), (completions, ("prompt",))):
            body = JsonBody(obj, big)
            sent = b"".join(await pieces_of(body))
            assert sent == as_httpx_sends(obj)
            assert len(body) == len(sent)
            assert b"".join(await pieces_of(body)) == sent  # again, for a retry
    assert chat["messages"] == [{"role": "user", "content": text}]  # the caller's is untouched


async def test_a_large_prompt_is_sent_a_chunk_at_a_time() -> None:
    prompt = " ydk word" * 400_000  # 3.6 MB
    body = JsonBody({"model": "m", "prompt": prompt}, ("prompt",))
    pieces = await pieces_of(body)
    assert max(map(len, pieces)) <= CHUNK_CHARS
    assert len(pieces) >= len(prompt) // CHUNK_CHARS
    assert json.loads(b"".join(pieces))["prompt"] == prompt


async def test_a_request_carries_its_length_not_a_chunked_upload() -> None:
    body = JsonBody({"model": "m", "prompt": 'quote " and \n é'}, ("prompt",))
    headers = {"Content-Length": str(len(body)), "Content-Type": "application/json"}
    request = httpx.Request("POST", "http://x", content=body, headers=headers)
    assert "transfer-encoding" not in request.headers
    assert await request.aread() == as_httpx_sends({"model": "m", "prompt": 'quote " and \n é'})


class Receiver:
    """A one-connection-at-a-time HTTP/1.1 server on a free loopback port that reads each
    request body as it arrives, keeping only its length and digest, and answers one SSE
    event: the body is never held whole in this process, so the heap shows the client's."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], int, str]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        remaining, digest = int(headers.get("content-length", "0")), hashlib.sha256()
        while remaining:
            piece = await reader.read(min(remaining, 1 << 16))
            assert piece, "the client closed the connection before the whole body"
            digest.update(piece)
            remaining -= len(piece)
        self.received.append((headers, int(headers.get("content-length", "0")), digest.hexdigest()))
        event = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
        body = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_a_large_prompt_goes_over_tcp_intact_without_a_second_copy(
    backend: Backend, api: ApiStyle
) -> None:
    prompt = "ydk settle \u201cquoted\u201d word. " * 200_000  # 6.6 MB of UTF-8, escapes none
    plan = RequestPlan(
        request_id="t0-r000001",
        tenant="tenant-0",
        phase="fill",
        intent="victim",
        size_label="1M",
        num_prompt_tokens=1,
        expected="accept",
        api=api,
        prompt=prompt,
        max_tokens=1,
    )
    receiver = Receiver()
    server = await asyncio.start_server(receiver.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with make_http_client(max_concurrency=1, backend=backend) as http:
            target = TargetClient(http, f"http://127.0.0.1:{port}", model="m")
            expected = await target.build_request(plan, Tenant("tenant-0")).aread()
            tracemalloc.start()
            try:
                observation = await target.send(
                    plan, Tenant("tenant-0"), t_scheduled_ns=time.perf_counter_ns()
                )
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    finally:
        server.close()
        await server.wait_closed()
    assert observation.ok, observation.error
    ((headers, length, digest),) = receiver.received
    assert "transfer-encoding" not in headers
    assert length == len(expected)
    assert digest == hashlib.sha256(expected).hexdigest()
    sent = json.loads(expected)
    assert (sent["messages"][0]["content"] if api == "chat" else sent["prompt"]) == prompt
    # the prompt's bytes (6.6 MB) are never materialised whole: a few chunks at a time
    assert peak < len(expected) // 4, f"heap peak {peak / 2**20:.1f} MiB while sending"
