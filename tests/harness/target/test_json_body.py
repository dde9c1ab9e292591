"""The streamed JSON body: the same bytes as httpx's `json=`, a known length, re-iterable,
and never more than one chunk of the big string encoded at a time."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.target import json_body
from harness.target.json_body import CHUNK_CHARS, JsonBody


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
