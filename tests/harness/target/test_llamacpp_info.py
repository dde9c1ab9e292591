"""llama.cpp limits from recorded /props, /slots and /v1/models answers of a real server
(xllamacpp, the tiny model of tests/harness/target/llamacpp/, n_ctx 1024 over 2 slots)."""

from __future__ import annotations

from typing import Any

from recorded_targets import Handler, RecordedTarget, fixture_json, json_reply, mock_client

from kvcanary.harness.target.limits import limits_from_facts
from kvcanary.harness.target.server_info import EngineFacts, read_engine_facts

BASE = "http://target"


def llamacpp_routes() -> dict[str, Handler]:
    return {
        "GET /props": json_reply(fixture_json("llamacpp_props.json")),
        "GET /slots": json_reply(fixture_json("llamacpp_slots.json")),
        "GET /v1/models": json_reply(fixture_json("llamacpp_models.json")),
    }


async def facts_of(routes: dict[str, Handler]) -> tuple[EngineFacts, RecordedTarget]:
    target = RecordedTarget(routes)
    async with mock_client({"target": target}) as client:
        return await read_engine_facts(client, BASE), target


async def test_n_ctx_from_props_is_the_pool_and_the_context() -> None:
    facts, target = await facts_of(llamacpp_routes())
    assert facts.engine == "llamacpp"
    assert facts.model == "/models/kvcanary-tiny-bpe.gguf"
    (side,) = facts.sides
    assert (side.pool_tokens, side.context_tokens, side.page_size) == (512, 512, None)
    assert side.source == "llamacpp:/props"
    assert side.fields == {"default_generation_settings.n_ctx": 512, "total_slots": 2}
    assert facts.context_tokens == 512
    assert facts.context_source == "llamacpp:/v1/models meta.n_ctx"
    assert "/metrics" not in target.paths()
    assert "/slots" not in target.paths()
    limits = limits_from_facts(facts)  # no flags needed
    assert (limits.pool_tokens, limits.context_tokens, limits.page_size) == (512, 512, 16)
    assert "pool: llamacpp:/props unified side" in limits.source
    assert "context: llamacpp:/v1/models meta.n_ctx" in limits.source


async def test_slots_answer_when_props_does_not() -> None:
    routes = llamacpp_routes()
    del routes["GET /props"]
    facts, _ = await facts_of(routes)
    (side,) = facts.sides
    assert (side.pool_tokens, side.source) == (512, "llamacpp:/slots")
    assert side.fields == {"slots.n_ctx": [512, 512]}
    assert [a.status for a in facts.attempts if a.url.endswith("/props")] == [404]


async def test_model_card_meta_when_props_and_slots_are_off() -> None:
    routes = llamacpp_routes()
    del routes["GET /props"]
    routes["GET /slots"] = json_reply(
        {"error": {"code": 501, "message": "This server does not support slots endpoint."}}, 501
    )
    facts, _ = await facts_of(routes)
    (side,) = facts.sides
    assert (side.pool_tokens, side.context_tokens) == (512, 512)
    assert side.source == "llamacpp:/v1/models meta.n_ctx"
    tried = " ".join(a.describe() for a in facts.attempts)
    assert "/props: HTTP 404" in tried
    assert "/slots: HTTP 501" in tried


async def test_props_without_n_ctx_is_recorded_not_guessed() -> None:
    props: dict[str, Any] = fixture_json("llamacpp_props.json")
    del props["default_generation_settings"]["n_ctx"]
    models: dict[str, Any] = fixture_json("llamacpp_models.json")
    del models["data"][0]["meta"]["n_ctx"]
    routes = {
        "GET /props": json_reply(props),
        "GET /v1/models": json_reply(models),
    }
    facts, _ = await facts_of(routes)
    assert facts.engine == "llamacpp"
    assert facts.sides == ()
    assert facts.context_tokens is None
    assert any(a.error == "no n_ctx" for a in facts.attempts)
