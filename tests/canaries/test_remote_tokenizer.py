"""RemoteTokenizer against SGLang-, vLLM- and llama.cpp-shaped servers (httpx.MockTransport).

The real llama.cpp server is tested in tests/harness/target/llamacpp/."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import pytest

from kvcanary.canaries import CanaryError, RemoteTokenizer

Handler = Callable[[httpx.Request], httpx.Response]


def fake_tokens(text: str) -> list[int]:
    return [len(word) for word in text.split()]


def sglang(calls: list[httpx.Request]) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.url.path != "/v1/tokenize":
            return httpx.Response(404)
        body = json.loads(request.content)
        tokens = fake_tokens(body["prompt"])
        return httpx.Response(
            200, json={"tokens": tokens, "count": len(tokens), "max_model_len": 8192}
        )

    return handle


def vllm(calls: list[httpx.Request]) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.url.path != "/tokenize":
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        if "messages" in body:  # a chat template that adds 5 tokens around the message
            tokens = [1, 2, 3, *fake_tokens(body["messages"][0]["content"]), 4, 5]
        else:
            tokens = fake_tokens(body["prompt"])
        return httpx.Response(
            200, json={"tokens": tokens, "count": len(tokens), "max_model_len": 32768}
        )

    return handle


def remote(handler: Handler, **kwargs: object) -> RemoteTokenizer:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return RemoteTokenizer(client, "http://target:30000/", **kwargs)  # type: ignore[arg-type]


async def test_sglang_shape_auto_detected() -> None:
    calls: list[httpx.Request] = []
    tokenizer = remote(sglang(calls), headers={"Authorization": "Bearer x"})
    assert await tokenizer.encode("one three fives") == [3, 5, 5]
    assert await tokenizer.count("a bb") == 2
    assert tokenizer.style == "sglang"
    assert tokenizer.max_model_len == 8192
    # two validation requests (a short and a longer text), then one per call
    assert [c.url.path for c in calls] == ["/v1/tokenize"] * 4
    assert calls[0].headers["authorization"] == "Bearer x"
    body = json.loads(calls[2].content)
    assert body == {"prompt": "one three fives", "add_special_tokens": False}
    with pytest.raises(CanaryError, match="does not render chat templates"):
        await tokenizer.chat_overhead("m")


async def test_vllm_shape_auto_detected_after_404_and_chat_overhead() -> None:
    calls: list[httpx.Request] = []
    tokenizer = remote(vllm(calls), model="llama")
    assert await tokenizer.count("a bb ccc") == 3
    assert tokenizer.style == "vllm"
    assert tokenizer.max_model_len == 32768
    assert [c.url.path for c in calls] == ["/v1/tokenize", "/tokenize", "/tokenize", "/tokenize"]
    assert json.loads(calls[1].content)["model"] == "llama"
    assert await tokenizer.count("x") == 1
    assert calls[-1].url.path == "/tokenize"
    assert await tokenizer.chat_overhead("llama") == 5
    chat = json.loads(next(c for c in calls if b"messages" in c.content).content)
    assert chat["add_generation_prompt"] is True
    assert chat["model"] == "llama"


async def test_explicit_style_uses_one_route_only() -> None:
    calls: list[httpx.Request] = []
    tokenizer = remote(sglang(calls), style="vllm")
    with pytest.raises(CanaryError, match="HTTP 404"):
        await tokenizer.count("hello")
    assert [c.url.path for c in calls] == ["/tokenize"]
    with pytest.raises(CanaryError, match=r"vllm: http://target:30000/tokenize answered HTTP 404"):
        await tokenizer.detect()


def llamacpp(calls: list[httpx.Request], *, with_pieces: bool = False) -> Handler:
    """llama.cpp's /tokenize: reads `content`; a body without it is tokenized as "" (200)."""

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.url.path != "/tokenize":
            return httpx.Response(404, text="File Not Found")
        body = json.loads(request.content)
        tokens = fake_tokens(body.get("content", ""))
        if body.get("add_special", True):  # llama.cpp's default: prepend the BOS token
            tokens = [1, *tokens]
        if with_pieces or body.get("with_pieces"):
            return httpx.Response(200, json={"tokens": [{"id": t, "piece": "x"} for t in tokens]})
        return httpx.Response(200, json={"tokens": tokens})

    return handle


async def test_llamacpp_detected_after_the_others_count_zero() -> None:
    calls: list[httpx.Request] = []
    tokenizer = remote(llamacpp(calls), model="tiny")
    assert await tokenizer.detect() == "llamacpp"
    assert await tokenizer.count("a bb ccc") == 3
    # /v1/tokenize: 404; /tokenize with {"prompt"}: 200 with no tokens (not a count); then content
    assert [c.url.path for c in calls[:2]] == ["/v1/tokenize", "/tokenize"]
    body = json.loads(calls[-1].content)
    assert body == {"content": "a bb ccc", "add_special": False, "with_pieces": False}
    assert tokenizer.endpoint == "http://target:30000/tokenize"


async def test_llamacpp_token_objects_are_read_as_ids() -> None:
    tokenizer = remote(llamacpp([], with_pieces=True), style="llamacpp")
    assert await tokenizer.encode("one three") == [3, 5]


async def test_a_zero_count_for_text_is_rejected_naming_the_endpoint() -> None:
    # what kvcanary accepted before: llama.cpp answering {"prompt": ...} with no tokens
    tokenizer = remote(lambda request: httpx.Response(200, json={"tokens": []}), style="vllm")
    with pytest.raises(CanaryError, match=r"vllm: http://target:30000/tokenize counted 0 tokens"):
        await tokenizer.detect()
    with pytest.raises(CanaryError, match=r"/tokenize counted 0 tokens for 5 characters"):
        await tokenizer.count("hello")


async def test_a_count_that_does_not_grow_with_the_text_is_rejected() -> None:
    tokenizer = remote(lambda request: httpx.Response(200, json={"tokens": [7]}))
    with pytest.raises(CanaryError, match="does not grow with the text") as caught:
        await tokenizer.detect()
    message = str(caught.value)
    for url in ("/v1/tokenize", "/tokenize"):
        assert f"http://target:30000{url}" in message


async def test_chat_overhead_unsupported_is_a_clear_error() -> None:
    def no_messages(request: httpx.Request) -> httpx.Response:
        if b"messages" in request.content:
            return httpx.Response(400, json={"error": "no messages"})
        return vllm([])(request)

    tokenizer = remote(no_messages)
    with pytest.raises(CanaryError, match="cannot tokenize chat messages"):
        await tokenizer.chat_overhead("m")


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"count": 2}', b'{"tokens": [1, 2], "count": 3}', b'{"tokens": "ab"}'],
)
async def test_malformed_answers_are_canary_errors(body: bytes) -> None:
    tokenizer = remote(lambda request: httpx.Response(200, content=body), style="sglang")
    with pytest.raises(CanaryError):
        await tokenizer.count("hello")


def test_bad_style_is_an_error() -> None:
    with pytest.raises(CanaryError, match="style"):
        remote(vllm([]), style="tgi")


# -- hostile answers: every read is bounded in bytes and in time ------------------------


class Endless(httpx.AsyncByteStream):
    """A body that never ends: `piece` after `piece` (after `pause_s` each), counting them."""

    def __init__(self, piece: bytes, pause_s: float = 0.0) -> None:
        self.piece = piece
        self.pause_s = pause_s
        self.num_sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            if self.pause_s:
                await asyncio.sleep(self.pause_s)
            self.num_sent += 1
            yield self.piece


async def test_a_huge_answer_is_cut_at_the_bound_not_read_to_its_end() -> None:
    body = Endless(b"1, " * 20_000)
    tokenizer = remote(
        lambda request: httpx.Response(200, stream=body), style="sglang", max_bytes=100_000
    )
    with pytest.raises(CanaryError, match="more than 100000 bytes; not read"):
        await tokenizer.count("hello")
    assert body.num_sent == 2  # 60 kB each: the second passed the bound, and reading stopped


async def test_a_dripping_answer_ends_at_the_exchange_deadline() -> None:
    # a byte every 50 ms resets any per-read timeout forever; only a deadline ends it
    drip = Endless(b" ", pause_s=0.05)
    tokenizer = remote(lambda request: httpx.Response(200, stream=drip), timeout_s=0.3)
    with pytest.raises(CanaryError, match=r"no complete answer within 0\.3 s"):
        await tokenizer.detect()


async def test_a_compressed_answer_is_refused_not_inflated() -> None:
    bomb = Endless(b"\x1f\x8b" + bytes(1000))  # never inflated, so never read past the head

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["accept-encoding"] == "identity"
        return httpx.Response(200, headers={"content-encoding": "gzip"}, stream=bomb)

    tokenizer = remote(handle, style="vllm")
    with pytest.raises(CanaryError, match="gzip-compressed though asked not to"):
        await tokenizer.count("hello")
    assert bomb.num_sent == 0


async def test_a_nesting_bomb_is_a_canary_error_not_a_recursion_error() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    tokenizer = remote(lambda request: httpx.Response(200, content=deep), style="sglang")
    with pytest.raises(CanaryError, match="nested too deeply"):
        await tokenizer.count("hello")


async def test_error_bodies_are_not_quoted_in_messages() -> None:
    """The message is printed; the body is the target's text (maybe another tenant's)."""
    foreign = "another customer's prompt text"
    tokenizer = remote(lambda request: httpx.Response(500, text=foreign), style="sglang")
    with pytest.raises(CanaryError, match=r"HTTP 500 \(30 bytes of error body\)") as raised:
        await tokenizer.count("hello")
    assert foreign not in str(raised.value)
    tokenizer = remote(lambda request: httpx.Response(200, text=foreign), style="sglang")
    with pytest.raises(CanaryError, match="malformed tokenize answer") as raised:
        await tokenizer.count("hello")
    assert foreign not in str(raised.value)


async def test_a_given_post_reads_every_answer() -> None:
    seen: list[tuple[str, int]] = []

    async def post(
        url: str, body: Mapping[str, Any], headers: Mapping[str, str], max_bytes: int
    ) -> tuple[int, bytes]:
        seen.append((url, max_bytes))
        return 200, json.dumps({"tokens": fake_tokens(body["prompt"])}).encode()

    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(599)))
    tokenizer = RemoteTokenizer(client, "http://t", style="sglang", post=post, max_bytes=4096)
    assert await tokenizer.count("a bb ccc") == 3
    assert seen == [("http://t/v1/tokenize", 4096)]
