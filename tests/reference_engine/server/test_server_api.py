"""The HTTP layer over fake sides: mini_lb routing, OpenAI shapes, SSE framing, errors, aborts.

These pin what the HTTP layer adds; the same behaviours over the real engine core are in
test_server_engine.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse
from server_fakes import FakeEngine

PROMPT = "The quick brown fox jumps over the lazy dog"


async def sse_events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    async with aconnect_sse(client, "POST", path, json=body) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [event.data async for event in source.aiter_sse()]


async def test_router_sends_both_sides_the_same_body_with_a_bootstrap_room(
    fake_engine: FakeEngine,
) -> None:
    for _ in range(2):
        r = await fake_engine.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status_code == 200
    await asyncio.sleep(0)  # prefill's exchange finishes in the background
    prefill, decode = fake_engine.prefill.received, fake_engine.decode.received
    assert [p.bootstrap_room for p in prefill] == [d.bootstrap_room for d in decode]
    assert prefill[0].input_ids == decode[0].input_ids
    rooms = {p.bootstrap_room for p in prefill}
    assert len(rooms) == 2
    assert all(0 <= room < 2**63 for room in rooms)


async def test_completion_body_has_text_and_engine_usage(fake_engine: FakeEngine) -> None:
    r = await fake_engine.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " ".join(PROMPT.split()[:4])
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["prompt_tokens"] == 9
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == 13
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_usage_at_the_client_is_decodes_untouched(fake_engine: FakeEngine) -> None:
    fake_engine.prefill.reported_prompt_tokens = 1  # the vulnerable placeholder's count
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4}
    usage = (await fake_engine.client.post("/v1/completions", json=body)).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (9, 4, 13)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = await sse_events(fake_engine.client, "/v1/completions", body)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["prompt_tokens"] == 9


async def test_a_merging_gateway_reports_prefills_prompt_count(
    merging_engine: FakeEngine,
) -> None:
    merging_engine.prefill.reported_prompt_tokens = 1
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4}
    usage = (await merging_engine.client.post("/v1/completions", json=body)).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (1, 4, 5)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = await sse_events(merging_engine.client, "/v1/completions", body)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["prompt_tokens"] == 1
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "The quick brown fox"


async def test_token_id_prompts_are_served(fake_engine: FakeEngine) -> None:
    r = await fake_engine.client.post("/v1/completions", json={"prompt": [791, 4062, 14198]})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "The quick brown"


async def test_chat_applies_the_documented_template(fake_engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = await fake_engine.client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 50}
    )
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "system: be brief\nuser: hi\nassistant:",
    }


async def test_chat_stream_is_valid_sse_with_usage_before_done(fake_engine: FakeEngine) -> None:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 3,
    }
    events = await sse_events(fake_engine.client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == "user: The"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_completion_stream_without_usage_option_has_no_usage_chunk(
    fake_engine: FakeEngine,
) -> None:
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 2}
    events = await sse_events(fake_engine.client, "/v1/completions", body)
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["The", " quick", ""]
    assert all("usage" not in c for c in chunks)


async def test_decode_rejection_is_the_clients_status_even_when_streaming(
    fake_engine: FakeEngine,
) -> None:
    prompt = " ".join(["word"] * 300)  # over the fake decode pool, under the context
    for stream in (False, True):
        r = await fake_engine.client.post(
            "/v1/completions", json={"prompt": prompt, "stream": stream}
        )
        assert r.status_code == 400
        error = r.json()
        assert error["object"] == "error"
        assert error["code"] == 400
        assert "exceeds the maximum number of tokens" in error["message"]


async def test_error_after_the_stream_started_is_an_sse_error_then_done(
    fake_engine: FakeEngine,
) -> None:
    fake_engine.decode.fail_after_tokens = 2
    events = await sse_events(
        fake_engine.client, "/v1/completions", {"prompt": PROMPT, "stream": True}
    )
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500
    assert error["message"] == "KV transfer failed"


async def test_error_after_tokens_without_streaming_is_the_error_status(
    fake_engine: FakeEngine,
) -> None:
    fake_engine.decode.fail_after_tokens = 2
    r = await fake_engine.client.post("/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 500
    assert r.json()["type"] == "InternalServerError"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT, "cache_salt": ""},
        {"prompt": PROMPT, "n": 2},
        {"max_tokens": 3},
        {"prompt": ""},
    ],
)
async def test_invalid_bodies_are_openai_400s(
    fake_engine: FakeEngine, body: dict[str, Any]
) -> None:
    r = await fake_engine.client.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["object"] == "error"


async def test_invalid_json_is_a_400(fake_engine: FakeEngine) -> None:
    r = await fake_engine.client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400


async def test_cache_salt_passes_through_and_the_bearer_token_is_only_hashed(
    fake_engine: FakeEngine,
) -> None:
    token = "sk-tenant-a-secret"
    for salt in ("salt-a", None):
        r = await fake_engine.client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "cache_salt": salt},
            headers={"authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200
    await fake_engine.client.post("/v1/completions", json={"prompt": PROMPT})
    first, second, anonymous = fake_engine.decode.received
    assert first.cache_salt == "salt-a"
    assert second.cache_salt is None
    assert first.tenant_key == second.tenant_key
    assert first.tenant_key is not None
    assert token not in first.tenant_key
    assert anonymous.tenant_key is None
    assert fake_engine.prefill.received[0].tenant_key == first.tenant_key


async def test_tokenize_and_detokenize_have_sglang_shapes(fake_engine: FakeEngine) -> None:
    r = await fake_engine.client.post("/v1/tokenize", json={"prompt": PROMPT})
    body = r.json()
    assert body == {"tokens": body["tokens"], "count": 9, "max_model_len": 512}
    r = await fake_engine.client.post("/v1/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"text": PROMPT}
    r = await fake_engine.client.post("/v1/tokenize", json={"prompt": ["a b", "c"]})
    assert r.json()["count"] == [2, 1]


async def test_models_advertise_the_context_length(fake_engine: FakeEngine) -> None:
    r = await fake_engine.client.get("/v1/models")
    assert r.json()["data"][0]["max_model_len"] == 512


async def test_server_info_through_the_router_has_mini_lb_shape(fake_engine: FakeEngine) -> None:
    for path in ("/get_server_info", "/server_info"):
        info = (await fake_engine.client.get(path)).json()
        assert set(info) == {"internal_states", "prefill", "decode"}
        prefill, decode = info["prefill"][0], info["decode"][0]
        assert prefill["disaggregation_mode"] == "prefill"
        assert decode["disaggregation_mode"] == "decode"
        for side in (prefill, decode):
            assert side["context_length"] == 512
            assert side["page_size"] == 16
            assert side["max_total_num_tokens"] == 256
            assert side["max_req_input_len"] == 250
        assert info["internal_states"] == decode["internal_states"]


async def test_metrics_merge_both_sides_under_sglang_names(fake_engine: FakeEngine) -> None:
    await fake_engine.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    text = (await fake_engine.client.get("/metrics")).text
    for name in (
        "sglang:token_usage",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_transfer_failed_reqs_total",
        "sglang:num_bootstrap_failed_reqs_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:router_time_to_first_token_seconds_bucket",
        "sglang:router_requests_total",
    ):
        assert name in text, name
    assert text.count("# TYPE sglang:token_usage gauge") == 1
    assert 'sglang:token_usage{disaggregation_mode="prefill"' in text
    assert 'sglang:generation_tokens_total{disaggregation_mode="decode"' in text


async def test_health(fake_engine: FakeEngine) -> None:
    assert (await fake_engine.client.get("/health")).status_code == 200


async def test_side_refuses_a_request_without_a_bootstrap_room() -> None:
    from server_fakes import FakeConfig, FakeDecode

    from kvcanary.reference_engine.server.app import build_side_app
    from kvcanary.reference_engine.server.asgi_transport import StreamingASGITransport

    app = build_side_app(FakeDecode(FakeConfig()), "decode", FakeConfig())
    async with httpx.AsyncClient(transport=StreamingASGITransport(app), base_url="http://d") as c:
        r = await c.post("/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 400
    assert "through the router" in r.json()["message"]


async def test_a_client_that_disconnects_mid_stream_aborts_both_sides(
    fake_engine: FakeEngine,
) -> None:
    fake_engine.decode.token_delay_s = 0.02
    body = {"prompt": " ".join(["word"] * 100), "max_tokens": 100, "stream": True}
    async with fake_engine.client.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            assert fake_engine.decode.num_allocated_pages() == 7
            break
    for _ in range(100):
        if fake_engine.decode.aborted and fake_engine.decode.num_allocated_pages() == 0:
            break
        await asyncio.sleep(0.01)
    assert fake_engine.decode.aborted == [fake_engine.decode.received[0].rid]
    assert fake_engine.decode.num_allocated_pages() == 0
    state = (await fake_engine.client.get("/kvcanary/state")).json()
    assert state["decode"][0]["num_running_requests"] == 0
    assert state["decode"][0]["num_allocated_pages"] == 0


async def test_a_client_that_leaves_before_the_first_token_aborts_prefill_too(
    fake_engine: FakeEngine,
) -> None:
    fake_engine.prefill.delay_s = 5.0
    fake_engine.decode.token_delay_s = 5.0
    request = asyncio.create_task(
        fake_engine.client.post("/v1/completions", json={"prompt": PROMPT})
    )
    for _ in range(200):
        if fake_engine.prefill.received and fake_engine.decode.received:
            break
        await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    for _ in range(200):
        if fake_engine.prefill.aborted and fake_engine.decode.aborted:
            break
        await asyncio.sleep(0.01)
    assert fake_engine.prefill.aborted == [fake_engine.prefill.received[0].rid]
    assert fake_engine.decode.aborted == [fake_engine.decode.received[0].rid]
