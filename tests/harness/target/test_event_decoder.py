"""`sse_stream.EventDecoder` against `httpx-sse` (the oracle) on random bodies and chunkings,
and `sse_stream`'s JSON fast path against `bounded.loads`."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.harness.target import sse_stream
from kvcanary.harness.target.bounded import MAX_JSON_DEPTH, StreamViolation, loads
from kvcanary.harness.target.sse_stream import EventDecoder

LINE_ENDS = st.sampled_from(["\n", "\r\n", "\r"])
FIELD = st.sampled_from(["data", "event", "id", "retry", "", "x"])
VALUE = st.text(alphabet=st.sampled_from([*'ab :é✓{}"\\', "\u2028"]), max_size=8)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            lines.append("")  # a blank line: dispatch
        else:
            colon = draw(st.sampled_from([":", ": ", ""]))
            lines.append(f"{draw(FIELD)}{colon}{draw(VALUE)}")
    text = "".join(line + draw(LINE_ENDS) for line in lines)
    if draw(st.booleans()):
        text += draw(VALUE)  # an unterminated last line
    data = text.encode()
    if draw(st.booleans()):
        data += b"\xff\xfe"  # invalid UTF-8 is replaced, not fatal
    return data


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


class Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def oracle(chunks: list[bytes]) -> list[tuple[str, str]]:
    """What httpx-sse makes of the body, less what a Transcript ignores anyway (events with
    neither an event name nor data, which only an `id:` line dispatches). httpx-sse names an
    unnamed event "message", as the specification's default type; ours leaves it empty."""

    async def decode() -> list[tuple[str, str]]:
        response = httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=Chunks(chunks)
        )
        return [(e.event, e.data) async for e in EventSource(response).aiter_sse()]

    events = [("" if event == "message" else event, data) for event, data in asyncio.run(decode())]
    return [(event, data) for event, data in events if event or data]


def ours(chunks: list[bytes]) -> list[tuple[str, str]]:
    decoder = EventDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    events += decoder.flush()
    events = [("" if event == "message" else event, data) for event, data in events]
    return [(event, data) for event, data in events if event or data]


@settings(max_examples=400, deadline=None)
@given(bodies(), st.lists(st.integers(0, 10_000), max_size=6))
def test_the_decoder_agrees_with_httpx_sse_on_any_chunking(data: bytes, points: list[int]) -> None:
    chunks = cut(data, points)
    assert ours(chunks) == oracle(chunks)


def test_a_line_split_into_many_chunks_is_joined_once() -> None:
    line = b"data: " + b"x" * 100_000 + b"\n\n"
    chunks = [line[i : i + 7] for i in range(0, len(line), 7)]
    assert ours(chunks) == [("", "x" * 100_000)]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=20,
)


def verdict(parse: Any, text: str) -> Any:
    try:
        return ("ok", parse(text))
    except StreamViolation as exc:
        return ("violation", str(exc))


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.sampled_from(["", "\\ud800", "[" * (MAX_JSON_DEPTH + 1), "{", "é"]))
def test_the_json_fast_path_gives_bounded_loads_verdicts(value: Any, noise: str) -> None:
    text = json.dumps(value)
    candidates = [text, text[:-1] + noise + text[-1:], noise + text, json.dumps([noise])]
    # around the document: whitespace `loads` allows, and data after it that it refuses
    candidates += [f" {text}", f"{text}\n", f"{text} {text}", text + noise]
    for candidate in candidates:
        assert verdict(sse_stream._parse_json, candidate) == verdict(loads, candidate)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1])
def test_the_json_fast_path_keeps_the_depth_limit(depth: int) -> None:
    text = "[" * depth + "]" * depth
    assert verdict(sse_stream._parse_json, text) == verdict(loads, text)
