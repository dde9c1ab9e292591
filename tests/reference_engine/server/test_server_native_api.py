"""SGLang's native routes on the bundled engine: `/generate` and the model-info routes.

These are what SGLang's own router (and SGLang clients) use: `/generate` takes `text` or
`input_ids` and `sampling_params.max_new_tokens`, answers `{"text", "meta_info"}` and streams
chunks whose `text` is everything generated so far. Over the fake sides (`server_fakes`) each
token echoes the prompt, so the expected text is the prompt's first words.
"""

from __future__ import annotations

import json
from typing import Any

from httpx_sse import aconnect_sse
from server_fakes import FakeEngine

PROMPT = "The quick brown fox jumps over the lazy dog"
IDS = [791, 4062, 14198, 39935]  # "The quick brown fox" in cl100k_base


async def test_generate_takes_text_and_answers_text_and_meta_info(fake_engine: FakeEngine) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    r = await fake_engine.client.post("/generate", json=body)
    assert r.status_code == 200
    answer = r.json()
    assert answer["text"] == "The quick brown"
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (9, 3)
    assert meta["id"] == fake_engine.decode.received[-1].rid
    both = [fake_engine.prefill.received[-1], fake_engine.decode.received[-1]]
    assert {req.bootstrap_room for req in both} == {both[0].bootstrap_room}  # the router's room


async def test_generate_takes_token_ids(fake_engine: FakeEngine) -> None:
    body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 4}}
    r = await fake_engine.client.post("/generate", json=body)
    assert r.status_code == 200
    assert r.json()["text"] == "The quick brown fox"
    assert fake_engine.decode.received[-1].input_ids == tuple(IDS)


async def test_generate_streams_the_text_so_far_in_every_chunk(fake_engine: FakeEngine) -> None:
    body: dict[str, Any] = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}}
    body["stream"] = True
    async with aconnect_sse(fake_engine.client, "POST", "/generate", json=body) as source:
        assert source.response.status_code == 200
        events = [event.data async for event in source.aiter_sse()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["text"] for c in chunks] == ["The", "The quick", "The quick brown", "The quick brown"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 3
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_generate_refuses_bodies_without_exactly_one_prompt(fake_engine: FakeEngine) -> None:
    for body in ({}, {"text": PROMPT, "input_ids": IDS}, {"text": [PROMPT, PROMPT]}):
        r = await fake_engine.client.post("/generate", json=body)
        assert r.status_code == 400, body
        assert r.json()["object"] == "error"
    assert not fake_engine.decode.received


async def test_model_info_routes_name_the_model(fake_engine: FakeEngine) -> None:
    for path in ("/get_model_info", "/model_info"):
        r = await fake_engine.client.get(path)
        assert r.status_code == 200
        info = r.json()
        assert info["model_path"] == "kvcanary-reference"
        assert info["is_generation"] is True
        assert info["max_model_len"] == 512
