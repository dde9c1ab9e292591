"""Bounded decoding and JSON parsing (`harness.target.bounded`)."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import AsyncIterator

import httpx
import pytest

from kvcanary.harness.target.bounded import (
    INFLATE_STEP,
    MAX_JSON_DEPTH,
    MeteredStream,
    ResponseTooLarge,
    StreamViolation,
    loads,
    take_over_decoding,
)


class Chunks(httpx.AsyncByteStream):
    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


async def read_all(stream: MeteredStream) -> bytes:
    return b"".join([piece async for piece in stream])


def split(data: bytes, size: int = 7) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


BODY = b"data: " + b"hello world " * 500


@pytest.mark.parametrize(
    ("codings", "encoded"),
    [
        ((), BODY),
        (("gzip",), gzip.compress(BODY, mtime=0)),
        (("deflate",), zlib.compress(BODY)),  # zlib-wrapped, as RFC 9110 says
        (("deflate",), zlib.compress(BODY, wbits=-zlib.MAX_WBITS)),  # raw, as some servers do
        (("deflate", "gzip"), gzip.compress(zlib.compress(BODY), mtime=0)),  # in this order
    ],
    ids=["identity", "gzip", "deflate", "raw-deflate", "deflate-then-gzip"],
)
async def test_bodies_are_decoded_in_any_split(codings: tuple[str, ...], encoded: bytes) -> None:
    stream = MeteredStream(Chunks(*split(encoded)), 1 << 20, codings)
    assert await read_all(stream) == BODY
    assert stream.num_bytes == len(BODY)


async def test_the_bound_counts_decoded_bytes_and_keeps_what_fits() -> None:
    bomb = gzip.compress(b"0" * (64 << 20))  # 64 MiB in about 64 KiB
    stream = MeteredStream(Chunks(bomb), 4096, ("gzip",))
    pieces: list[bytes] = []

    async def read() -> None:
        async for piece in stream:
            pieces.append(piece)

    with pytest.raises(ResponseTooLarge):
        await read()
    assert b"".join(pieces) == b"0" * 4096
    assert stream.num_bytes <= 4096 + INFLATE_STEP


@pytest.mark.parametrize(("codings", "body"), [(("br",), b"x"), (("gzip",), b"not gzip at all")])
async def test_unknown_or_broken_encodings_are_violations(
    codings: tuple[str, ...], body: bytes
) -> None:
    with pytest.raises(StreamViolation):
        await read_all(MeteredStream(Chunks(body), 1 << 20, codings))


def test_httpx_is_told_not_to_decode() -> None:
    response = httpx.Response(200, headers={"Content-Encoding": "identity, gzip"})
    assert take_over_decoding(response) == ("gzip",)
    assert "content-encoding" not in response.headers


def test_depth_is_limited_before_parsing() -> None:
    assert loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(StreamViolation, match="nested deeper"):
        loads("[" * 10**5 + "]" * 10**5)
    with pytest.raises(StreamViolation, match="nested deeper"):
        loads('{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1))


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = '{"a": "' + "[{" * 1000 + '\\"", "b": [1]}'
    assert loads(text)["b"] == [1]


def test_size_is_limited() -> None:
    with pytest.raises(StreamViolation, match="characters"):
        loads("[" + "1," * 1000 + "1]", max_chars=100)


def test_lone_surrogates_are_replaced_and_pairs_kept() -> None:
    value = loads('{"k\\udc00": ["a\\ud800b", "\\ud83d\\ude00"]}')
    assert value == {"k\ufffd": ["a\ufffdb", "\U0001f600"]}
    "".join(value["k\ufffd"]).encode()  # encodable now


@pytest.mark.parametrize("text", ["{", "", "nul", '{"a": 1}}'])
def test_malformed_json_is_a_violation(text: str) -> None:
    with pytest.raises(StreamViolation, match="malformed"):
        loads(text)


def test_an_unterminated_string_of_escaped_quotes_is_refused_in_linear_time() -> None:
    # a depth scan that ran before parsing took quadratic time on this (16 K chars: 4 s);
    # at this size it would outlast the test timeout
    text = "[1]," * 100 + '"' + '\\"' * 200_000
    with pytest.raises(StreamViolation, match="malformed"):
        loads(text)
