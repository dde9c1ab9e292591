"""TargetClient against a misbehaving server, both in-process (ASGITransport) and over
loopback TCP (uvicorn): every misbehaviour becomes an error kind, nothing escapes, text
stays bounded."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import misbehaving_server as server
import pytest

from kvcanary.harness.record.observation import Observation
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import Backend
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant

TENANT = Tenant(name="tenant-0")
MAX_BYTES = 1024 * 1024
READ_TIMEOUT = httpx.Timeout(30.0)
"""Generous: only the cases about timeouts set a short deadline of their own, so a loaded
machine never turns a slow answer into a timeout."""
ANSWER_DEADLINE_S = 60.0
ASGI_ROOT = "http://in-process"


def make_plan(api: ApiStyle = "chat", max_tokens: int = 4, **overrides: Any) -> RequestPlan:
    fields: dict[str, Any] = {
        "request_id": "t0-r000001",
        "tenant": "tenant-0",
        "phase": "probe",
        "intent": "probe",
        "size_label": "pool+1",
        "num_prompt_tokens": 3,
        "expected": "reject",
        "api": api,
        "prompt": "three word prompt",
        "max_tokens": max_tokens,
    }
    return RequestPlan(**(fields | overrides))


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    with server.serve() as url:
        yield url


def tcp_client(backend: Backend, read_s: float = 30.0) -> httpx.AsyncClient:
    """Reads time out only where a test asks for a short `read_s` (a hang it is about)."""
    return make_http_client(timeout=httpx.Timeout(30.0, read=read_s), backend=backend)


@pytest.fixture(params=["asgi", "uvicorn", "uvicorn-aiohttp"])
async def http(request: pytest.FixtureRequest, live_url: str) -> AsyncIterator[tuple[Any, str]]:
    """An httpx client and the server root it reaches: in-process, or over TCP with
    httpcore or aiohttp doing the I/O."""
    if request.param == "asgi":
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, timeout=READ_TIMEOUT) as client:
            yield client, ASGI_ROOT
        return
    backend: Backend = "aiohttp" if request.param == "uvicorn-aiohttp" else "httpx"
    async with make_http_client(timeout=READ_TIMEOUT, backend=backend) as client:
        yield client, live_url


async def observe(
    http: tuple[httpx.AsyncClient, str], behaviour: str, plan: RequestPlan | None = None, **kw: Any
) -> Observation:
    client, root = http
    kw.setdefault("max_response_bytes", MAX_BYTES)
    kw.setdefault("deadline_s", ANSWER_DEADLINE_S)
    target = TargetClient(client, f"{root}/{behaviour}", model="m", **kw)
    return await target.send(plan or make_plan(), TENANT, t_scheduled_ns=time.perf_counter_ns())


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_well_formed_stream(http: tuple[httpx.AsyncClient, str], api: ApiStyle) -> None:
    observation = await observe(http, "ok", make_plan(api, max_tokens=5))
    assert observation.ok, observation.error
    assert observation.text == "".join(server.chunk_text(i) for i in range(5))
    assert observation.num_chunks == 5
    assert observation.usage.prompt_tokens == 3
    assert observation.usage.completion_tokens == 5
    assert observation.finish_reason == "length"


async def test_non_streaming(http: tuple[httpx.AsyncClient, str]) -> None:
    observation = await observe(http, "ok", make_plan("completions", max_tokens=3), stream=False)
    assert observation.ok, observation.error
    assert observation.text == "word0 word1 word2 "


@pytest.mark.parametrize(
    ("behaviour", "kind", "text"),
    [
        ("malformed", "protocol", "word0 "),
        ("truncated", "truncated", "word0 word1 "),
        ("status_500", "http_status", ""),
        ("status_400", "http_status", ""),
        ("error_after_200", "error_in_success", "word0 "),
        ("error_event", "error_in_success", "word0 "),
        ("not_sse", "protocol", ""),
        ("hang_mid_stream", "timeout", "word0 "),
        ("no_such_behaviour", "http_status", ""),
    ],
)
async def test_misbehaviour_becomes_an_error_kind(
    http: tuple[httpx.AsyncClient, str], behaviour: str, kind: str, text: str
) -> None:
    # asgi buffers whole bodies and ignores httpx timeouts: only the deadline ends a hang,
    # and a body that never ends is never seen at all
    deadline_s = 0.5 if kind == "timeout" else ANSWER_DEADLINE_S
    observation = await observe(http, behaviour, deadline_s=deadline_s)
    assert observation.error_kind == kind, observation.error
    buffered_hang = behaviour == "hang_mid_stream" and http[1] == ASGI_ROOT
    assert observation.text == ("" if buffered_hang else text)
    assert not observation.ok
    if kind == "http_status":
        assert observation.error is not None
        assert "on purpose" in observation.error or "no such" in observation.error


async def test_keepalive_comments_crlf_and_missing_space(
    http: tuple[httpx.AsyncClient, str],
) -> None:
    observation = await observe(http, "keepalive", make_plan("completions"))
    assert observation.ok, observation.error
    assert observation.text == "word0 word1 "
    assert observation.finish_reason == "stop"


@pytest.mark.parametrize("behaviour", ["huge", "huge_line"])
async def test_huge_responses_are_cut_at_the_bound(
    http: tuple[httpx.AsyncClient, str], behaviour: str
) -> None:
    observation = await observe(http, behaviour)
    assert observation.error_kind == "too_large"
    assert observation.num_text_chars <= MAX_BYTES
    assert len(observation.text) == observation.num_text_chars
    if behaviour == "huge":
        assert observation.num_text_chars > 0


async def test_hang_before_the_response_times_out_over_tcp(live_url: str, backend: Backend) -> None:
    async with tcp_client(backend, read_s=0.3) as client:
        observation = await observe((client, live_url), "hang", deadline_s=None)
    assert observation.error_kind == "timeout"
    assert observation.error is not None
    assert "ReadTimeout" in observation.error
    assert observation.status is None


async def test_hang_before_the_response_hits_the_deadline_in_process() -> None:
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport) as client:
        observation = await observe((client, "http://m"), "hang", deadline_s=0.2)
    assert observation.error_kind == "timeout"
    assert "deadline" in (observation.error or "")


async def test_connection_reset_mid_stream_is_truncated(live_url: str, backend: Backend) -> None:
    async with tcp_client(backend) as client:
        observation = await observe((client, live_url), "reset")
    assert observation.error_kind == "truncated"
    assert observation.status == 200
    assert observation.text == "word0 "


async def test_connection_refused_is_connect(backend: Backend) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and now has no listener
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with tcp_client(backend) as client:
        observation = await observe((client, f"http://127.0.0.1:{port}"), "ok")
    assert observation.error_kind == "connect"
    assert observation.status is None


async def test_slow_trickle_within_read_timeout_completes(live_url: str, backend: Backend) -> None:
    # each gap (TRICKLE_DELAY_S) is far below the read timeout, the whole stream far below
    # the deadline: a per-read timeout never fires, however loaded the machine
    async with tcp_client(backend, read_s=2.0) as client:
        observation = await observe(
            (client, live_url), "trickle", make_plan(max_tokens=12), deadline_s=60.0
        )
    assert observation.ok, observation.error
    assert observation.num_chunks == 12


async def test_slow_trickle_past_the_deadline_times_out(live_url: str, backend: Backend) -> None:
    # 1000 chunks take 50 s at least; the first comes TRICKLE_DELAY_S after the headers
    async with tcp_client(backend, read_s=2.0) as client:
        observation = await observe(
            (client, live_url), "trickle", make_plan(max_tokens=1000), deadline_s=1.0
        )
    assert observation.error_kind == "timeout"
    assert 0 < observation.num_chunks < 1000


async def test_timestamps_follow_the_server_over_tcp(live_url: str, backend: Backend) -> None:
    """The first token is stamped when the first *content* chunk arrives: after the server
    wrote it, before the server wrote the next one (chunks are PACED_DELAY_S apart, and a
    role-only chunk goes out PACED_DELAY_S before the first content)."""
    plan = make_plan(max_tokens=3, prompt=f"stamp this {backend} request")
    async with tcp_client(backend) as client:
        observation = await observe((client, live_url), "paced", plan)
    assert observation.ok, observation.error
    writes = server.WRITE_STAMPS[plan.prompt]
    assert len(writes) == 3
    first_byte, first_token = observation.t_first_byte_ns, observation.t_first_token_ns
    assert first_byte is not None
    assert first_token is not None
    assert observation.t_done_ns is not None
    assert observation.t_sent_ns <= first_byte <= first_token <= observation.t_done_ns
    assert writes[0] <= first_token < writes[1]
    assert writes[2] <= observation.t_done_ns


async def test_abort_really_drops_the_connection(live_url: str, backend: Backend) -> None:
    before = server.DISCONNECTS.count("hang_mid_stream")
    async with tcp_client(backend) as client:
        observation = await observe(
            (client, live_url), "hang_mid_stream", make_plan(disconnect_after_chunks=1)
        )
    assert observation.error_kind == "disconnected"
    assert observation.text == "word0 "
    for _ in range(200):  # the server notices the disconnect on its own loop
        if server.DISCONNECTS.count("hang_mid_stream") > before:
            break
        await asyncio.sleep(0.01)
    assert server.DISCONNECTS.count("hang_mid_stream") > before


async def test_completed_streams_reuse_their_connection(live_url: str, backend: Backend) -> None:
    async with tcp_client(backend) as client:
        start = len(server.CLIENT_PORTS)
        for _ in range(3):
            observation = await observe((client, live_url), "ok")
            assert observation.ok, observation.error
    ports = server.CLIENT_PORTS[start:]
    assert len(ports) == 3
    assert len(set(ports)) == 1, ports
