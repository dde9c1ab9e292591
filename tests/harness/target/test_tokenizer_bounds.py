"""The target's tokenize route read as hostile input (`harness.target.tokenizer.bounded_post`):
a huge, dripping or gzip-bombed answer ends the `--tokenizer server` start-up check with the
usual one-line `ConfigError`, in bounded memory and bounded time, over real TCP
(`fault_server` under uvicorn); a compressed answer that is not a bomb is still read."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator

import fault_server
import httpx
import misbehaving_server
import pytest
from misbehaving_server import Receive, Scope, Send, read_body
from test_fault_injection import HEAP_BOUND, HeapPeak

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.target.client import make_http_client
from kvcanary.harness.target.tokenizer import remote_tokenizer
from kvcanary.tenants.tenant import Tenant


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with misbehaving_server.serve(fault_server.app) as root:
        yield root


# fault (served at every path, the tokenize routes included) -> what the message says
FAULTS = [
    ("gzip_bomb", "more than 1048576 bytes"),
    ("deflate_bomb", "more than 1048576 bytes"),
    ("body_200mb", "more than 1048576 bytes"),
    ("trickle_1bps", "within 1 s|ReadTimeout"),
    ("status_500_gzip", "HTTP 500"),
]


@pytest.mark.parametrize(("fault", "said"), FAULTS)
async def test_a_hostile_tokenize_route_is_one_line_in_bounded_memory(
    url: str, fault: str, said: str
) -> None:
    with HeapPeak(True) as heap:
        async with make_http_client(timeout=httpx.Timeout(5.0, read=1.0)) as http:
            with pytest.raises(ConfigError, match="no usable tokenize route") as raised:
                await remote_tokenizer(http, f"{url}/{fault}", "m", Tenant("t"))
    message = str(raised.value)
    assert "\n" not in message
    assert any(word in message for word in said.split("|")), message
    assert heap.peak < HEAP_BOUND, f"{fault}: heap peak {heap.peak / 2**20:.1f} MiB"


async def _gzip_tokenize(scope: Scope, receive: Receive, send: Send) -> None:
    """A tokenize route behind a gateway that compresses although asked not to."""
    body = await read_body(receive)
    if scope["path"] != "/v1/tokenize":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    tokens = list(range(len(json.loads(body)["prompt"].split())))
    answer = zlib.compress(json.dumps({"tokens": tokens}).encode(), wbits=16 + zlib.MAX_WBITS)
    headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def test_a_compressed_tokenize_answer_is_still_read() -> None:
    with misbehaving_server.serve(_gzip_tokenize) as root:
        async with make_http_client() as http:
            remote = await remote_tokenizer(http, root, "m", Tenant("t"))
            assert remote.style == "sglang"
            assert await remote.count(" three word text") == 3
