"""TargetClient's behaviour: request shapes, SSE parsing, error mapping, bounds, cancellation.

Every test that takes the `target` fixture runs three times: in-process on
`httpx.MockTransport`, and over real loopback TCP on each client backend
(`harness.target.http_client.BACKENDS`), the handler served by `handler_server` (its pieces
written one by one, its pauses kept, its failures turned into stalls and aborted
connections). Transport errors raised by a handler itself are in-process only; their real
TCP counterparts are in test_client_tcp.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import handler_server
import httpx
import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import BACKENDS
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant

TENANT = Tenant(name="tenant-0")
Handler = Callable[[httpx.Request], Any]
Target = Callable[..., TargetClient]
"""`target(handler, **TargetClient options)`: a client whose requests `handler` answers."""
TCP_TIMEOUT = httpx.Timeout(10.0, read=2.0)
"""Over TCP: a stalled stream ends in a read timeout after this long."""


def make_plan(api: ApiStyle = "chat", **overrides: Any) -> RequestPlan:
    fields: dict[str, Any] = {
        "request_id": "t0-r000001",
        "tenant": "tenant-0",
        "phase": "fill",
        "intent": "victim",
        "size_label": "0.5*limit",
        "num_prompt_tokens": 3,
        "expected": "accept",
        "api": api,
        "prompt": "hello canary world",
        "max_tokens": 8,
    }
    fields.update(overrides)
    return RequestPlan(**fields)


def sse(*objects: Any, done: bool = True) -> bytes:
    events = [b"data: " + json.dumps(obj).encode() + b"\n\n" for obj in objects]
    if done:
        events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def chat_chunk(content: str | None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


STREAM_OBJECTS = (
    chat_chunk(None, role="assistant"),
    chat_chunk("Repeat: "),
    chat_chunk("", reasoning_content="thinking "),
    chat_chunk("héllo wörld ✓"),
    chat_chunk(" end", finish="stop"),
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    },
)
STREAM_TEXT = "Repeat: \nthinking \nhéllo wörld ✓ end"
"""The field changes twice (content, reasoning_content, content): a separator each time."""


class Pieces(httpx.AsyncByteStream):
    """A response body delivered in the given pieces; records whether it was read to the end."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.num_served = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            self.num_served += 1
            yield piece

    async def aclose(self) -> None:
        self.closed = True


def split(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


def event_stream(body: Pieces, status: int = 200) -> httpx.Response:
    return httpx.Response(status, headers={"content-type": "text/event-stream"}, stream=body)


def mock_target(handler: Handler, **kwargs: Any) -> TargetClient:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return TargetClient(client, kwargs.pop("base_url", "http://target:8000"), model="m", **kwargs)


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[handler_server.HandlerServer]:
    with handler_server.serve() as server:
        yield server


@pytest.fixture(params=["mock", *BACKENDS])
async def target(
    request: pytest.FixtureRequest, tcp_server: handler_server.HandlerServer
) -> AsyncIterator[Target]:
    """In-process, or over loopback TCP with that backend doing the I/O."""
    if request.param == "mock":
        yield mock_target
        return
    clients: list[httpx.AsyncClient] = []

    def over_tcp(handler: Handler, **kwargs: Any) -> TargetClient:
        tcp_server.handler = handler
        path = httpx.URL(kwargs.pop("base_url", "http://target:8000")).path
        http = make_http_client(max_concurrency=4, timeout=TCP_TIMEOUT, backend=request.param)
        clients.append(http)
        return TargetClient(http, tcp_server.url + path.rstrip("/"), model="m", **kwargs)

    try:
        yield over_tcp
    finally:
        tcp_server.handler = None
        for http in clients:
            await http.aclose()


async def eventually(condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within a few seconds (over TCP the server learns that the
    client went away a moment after the client returns)."""
    for _ in range(500):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


async def send(client: TargetClient, plan: RequestPlan | None = None, **kwargs: Any) -> Any:
    return await client.send(
        plan or make_plan(), TENANT, t_scheduled_ns=time.perf_counter_ns(), **kwargs
    )


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_request_shape_and_credentials(
    api: ApiStyle, monkeypatch: pytest.MonkeyPatch, target: Target
) -> None:
    monkeypatch.setenv("KVC_TEST_KEY", "sk-planted-secret")
    monkeypatch.setenv("KVC_ORG", "org-7")
    tenant = Tenant(
        name="tenant-0",
        api_key_env="KVC_TEST_KEY",
        headers={"X-Org": "${KVC_ORG}", "X-Plain": "p"},
        cache_salt="salt-0",
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return event_stream(Pieces([sse(chat_chunk("ok", finish="stop"))]))

    client = target(handler, base_url="http://target:8000/v1/")
    observation = await client.send(make_plan(api), tenant, t_scheduled_ns=time.perf_counter_ns())
    assert observation.ok, observation.error
    (request,) = seen
    assert request.url.path == ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    assert request.headers["authorization"] == "Bearer sk-planted-secret"
    assert request.headers["x-org"] == "org-7"
    assert request.headers["x-plain"] == "p"
    assert request.headers["accept-encoding"] == "identity"
    body = json.loads(request.content)
    assert body["model"] == "m"
    assert body["max_tokens"] == 8
    assert body["temperature"] == 0
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "salt-0"
    if api == "chat":
        assert body["messages"] == [{"role": "user", "content": "hello canary world"}]
        assert "prompt" not in body
    else:
        assert body["prompt"] == "hello canary world"
        assert "messages" not in body


async def test_unset_credential_is_a_config_error_before_sending(target: Target) -> None:
    calls: list[httpx.Request] = []
    tenant = Tenant(name="tenant-0", api_key_env="KVC_SURELY_UNSET_VARIABLE")
    client = target(lambda request: calls.append(request))
    with pytest.raises(ConfigError, match="KVC_SURELY_UNSET_VARIABLE"):
        await client.send(make_plan(), tenant, t_scheduled_ns=0)
    assert calls == []


@pytest.mark.parametrize("url", ["target:8000", "ftp://target", "http://"])
def test_bad_base_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="target URL"):
        TargetClient(httpx.AsyncClient(), url, model="m")


@pytest.mark.parametrize("piece_size", [1, 2, 7, 61, 10_000])
async def test_sse_split_anywhere_gives_the_same_observation(
    piece_size: int, target: Target
) -> None:
    body = sse(*STREAM_OBJECTS)
    deltas: list[tuple[str, str]] = []
    client = target(lambda request: event_stream(Pieces(split(body, piece_size))))
    observation = await send(client, on_text=lambda *delta: deltas.append(delta))
    assert observation.error_kind is None, observation.error
    assert observation.text == STREAM_TEXT
    assert deltas == [
        ("Repeat: ", "content"),
        ("\nthinking ", "reasoning_content"),
        ("\nhéllo wörld ✓", "content"),
        (" end", "content"),
    ]
    assert observation.num_chunks == 4
    assert observation.num_text_chars == len(STREAM_TEXT)
    assert observation.finish_reason == "stop"
    assert (observation.usage.prompt_tokens, observation.usage.completion_tokens) == (3, 4)
    assert observation.usage.cached_tokens == 2


async def test_timestamps_are_ordered_and_queueing_is_kept_apart(target: Target) -> None:
    client = target(lambda request: event_stream(Pieces(split(sse(*STREAM_OBJECTS), 5))))
    scheduled = time.perf_counter_ns() - 5_000_000
    observation = await client.send(make_plan(), TENANT, t_scheduled_ns=scheduled)
    assert observation.t_first_byte_ns is not None
    assert observation.t_first_token_ns is not None
    assert observation.t_done_ns is not None
    assert observation.t_scheduled_ns == scheduled
    assert observation.queue_ns >= 5_000_000
    assert (
        scheduled
        < observation.t_sent_ns
        <= observation.t_first_byte_ns
        <= observation.t_first_token_ns
        <= observation.t_done_ns
    )


async def test_first_token_is_the_first_event_with_text_not_the_role_chunk(target: Target) -> None:
    role_only = sse(chat_chunk(None, role="assistant"), done=False)
    body = Pieces([role_only, sse(chat_chunk("a", finish="stop"))])
    stamps: list[int] = []

    class Stamped(Pieces):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for piece in self.pieces:
                await asyncio.sleep(0.001)
                stamps.append(time.perf_counter_ns())
                yield piece

    body = Stamped(body.pieces)
    observation = await send(target(lambda request: event_stream(body)))
    assert observation.t_first_token_ns is not None
    assert observation.t_first_token_ns >= stamps[1]


async def test_completions_stream_and_no_done_after_finish_reason_is_complete(
    target: Target,
) -> None:
    objects = [
        {"choices": [{"text": t, "finish_reason": f}]} for t, f in [("a", None), ("b", "length")]
    ]
    client = target(lambda request: event_stream(Pieces([sse(*objects, done=False)])))
    observation = await send(client, make_plan("completions"))
    assert observation.ok
    assert observation.text == "ab"
    assert observation.finish_reason == "length"


async def test_stream_without_done_or_finish_reason_is_truncated(target: Target) -> None:
    body = sse(chat_chunk("a"), chat_chunk("b"), done=False)
    observation = await send(target(lambda request: event_stream(Pieces([body]))))
    assert observation.error_kind == "truncated"
    assert observation.status == 200
    assert not observation.ok
    assert observation.text == "ab"


async def test_disconnect_after_chunks_drops_the_stream(target: Target) -> None:
    bodies: list[Pieces] = []

    class Paced(Pieces):
        """Over TCP a body written at once would sit whole in the socket buffers."""

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for piece in self.pieces:
                await asyncio.sleep(1.0 if self.num_served == 0 else 0.02)
                self.num_served += 1
                yield piece

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(Paced([sse(chat_chunk(f"c{i} "), done=False) for i in range(50)]))
        return event_stream(bodies[-1])

    client = target(handler)
    observation = await send(client, make_plan(disconnect_after_chunks=2))
    assert observation.error_kind == "disconnected"
    assert observation.text == "c0 c1 "
    assert await eventually(lambda: bodies[0].closed)
    assert bodies[0].num_served < 50
    before_body = await send(client, make_plan(disconnect_after_chunks=0))
    assert before_body.error_kind == "disconnected"
    assert before_body.text == ""
    assert await eventually(lambda: bodies[1].closed)
    assert bodies[1].num_served == 0


async def test_error_object_inside_a_200_stream_is_an_error_in_success_and_keeps_text(
    target: Target,
) -> None:
    body = sse(chat_chunk("partial"), {"error": {"message": "boom", "code": 500}})
    observation = await send(target(lambda request: event_stream(Pieces([body]))))
    assert observation.error_kind == "error_in_success"
    assert observation.error is not None
    assert "boom" in observation.error
    assert observation.text == "partial"


async def test_vllm_error_response_with_http_200_is_an_error_in_success(target: Target) -> None:
    """vLLM's `ErrorResponse` shape, sent whole with a success status: not an empty answer."""
    error = {
        "object": "error",
        "message": "prompt too long",
        "type": "BadRequestError",
        "code": 400,
    }
    streamed = sse(error)
    observation = await send(target(lambda request: event_stream(Pieces([streamed]))))
    assert (observation.status, observation.error_kind) == (200, "error_in_success")
    assert observation.error is not None
    assert "prompt too long" in observation.error
    assert not observation.ok


@pytest.mark.parametrize(
    "bad",
    [
        b"data: {not json}\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"choices": {"a": 1}}\n\n',
        b'data: {"choices": [{"delta": {"content": 5}}]}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": "1"}}\n\n',
    ],
)
async def test_malformed_events_are_protocol_errors(bad: bytes, target: Target) -> None:
    body = sse(chat_chunk("ok "), done=False) + bad + b"data: [DONE]\n\n"
    observation = await send(target(lambda request: event_stream(Pieces([body]))))
    assert observation.error_kind == "protocol"
    assert observation.text == "ok "


async def test_http_status_keeps_a_bounded_error_body(target: Target) -> None:
    big = b'{"error": {"message": "too long' + b"!" * 200_000 + b'"}}'
    response = httpx.Response(400, headers={"content-type": "application/json"}, content=big)
    observation = await send(target(lambda request: response, max_response_bytes=4096))
    assert observation.status == 400
    assert observation.error_kind == "http_status"
    assert observation.error is not None
    assert observation.error.startswith('HTTP 400: {"error": {"message": "too long')
    assert len(observation.error) <= 2000 + len("HTTP 400: ")


async def test_non_streaming_mode_and_json_answer_to_a_stream_request(target: Target) -> None:
    answer: dict[str, Any] = {
        "choices": [{"message": {"content": "whole answer"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=answer)

    for stream in (False, True):
        observation = await send(target(handler, stream=stream))
        assert observation.ok, observation.error
        assert observation.text == "whole answer"
        assert observation.usage.prompt_tokens == 3
        assert observation.t_first_token_ns is not None
    assert seen[0]["stream"] is False
    assert "stream_options" not in seen[0]
    # a whole JSON body is complete even where the target leaves out finish_reason
    del answer["choices"][0]["finish_reason"]
    assert (await send(target(handler, stream=False))).ok
    broken = httpx.Response(200, headers={"content-type": "application/json"}, content=b"{oops")
    observation = await send(target(lambda request: broken, stream=False))
    assert observation.error_kind == "protocol"


async def test_body_bound_gives_too_large_with_bounded_text(target: Target) -> None:
    pieces = [sse(chat_chunk("x" * 1000), done=False) for _ in range(100)]
    observation = await send(
        target(lambda request: event_stream(Pieces(pieces)), max_response_bytes=20_000)
    )
    assert observation.error_kind == "too_large"
    assert 0 < observation.num_text_chars <= 20_000


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused"), "connect"),
        (httpx.ConnectTimeout("slow"), "connect"),
        (httpx.ReadTimeout("slow"), "timeout"),
        (httpx.RemoteProtocolError("server hung up"), "protocol"),
        (httpx.ReadError("reset"), "connect"),
    ],
)
async def test_transport_errors_before_a_response(exc: Exception, kind: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    observation = await send(mock_target(handler))
    assert observation.error_kind == kind
    assert observation.status is None
    assert observation.t_first_byte_ns is None


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ReadTimeout("stalled"), "timeout"),
        (httpx.RemoteProtocolError("incomplete chunked read"), "truncated"),
        (httpx.ReadError("reset"), "truncated"),
    ],
)
async def test_transport_errors_mid_stream(exc: Exception, kind: str, target: Target) -> None:
    class Failing(Pieces):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield sse(chat_chunk("partial"), done=False)
            raise exc

    observation = await send(target(lambda request: event_stream(Failing([]))))
    assert observation.error_kind == kind
    assert observation.status == 200
    assert observation.text == "partial"


async def test_cancellation_propagates(target: Target) -> None:
    started = asyncio.Event()  # set by the client, on the text of the first event

    class Endless(Pieces):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield sse(chat_chunk("a"), done=False)
            await asyncio.Event().wait()
            yield b""  # pragma: no cover

    body = Endless([])
    client = target(lambda request: event_stream(body))
    task = asyncio.create_task(send(client, on_text=lambda *delta: started.set()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await eventually(lambda: body.closed)


async def test_deadline_bounds_a_whole_request(target: Target) -> None:
    class Trickle(Pieces):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for i in range(1000):
                yield sse(chat_chunk(f"{i} "), done=False)
                await asyncio.sleep(0.01)

    body = Trickle([])
    observation = await send(target(lambda request: event_stream(body), deadline_s=0.3))
    assert observation.error_kind == "timeout"
    assert observation.text.startswith("0 ")
    assert await eventually(lambda: body.closed)


async def test_detector_errors_are_not_swallowed(target: Target) -> None:
    def detector(delta: str, field: str = "content") -> None:
        raise ZeroDivisionError("detector bug")

    client = target(lambda request: event_stream(Pieces([sse(chat_chunk("a", finish="stop"))])))
    with pytest.raises(ZeroDivisionError):
        await send(client, on_text=detector)
