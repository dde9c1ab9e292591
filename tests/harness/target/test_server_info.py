"""Engine facts from recorded SGLang, mini_lb, vLLM and OpenAI-only responses."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from recorded_targets import (
    Handler,
    RecordedTarget,
    Reply,
    Seen,
    fixture_json,
    json_reply,
    mini_lb_routes,
    mock_client,
    sglang_routes,
    text_reply,
    vllm_routes,
)

from kvcanary.harness.target.discovery_fetch import Fetcher
from kvcanary.harness.target.server_info import (
    REFERENCE_ENGINE_VERSION,
    EngineFacts,
    read_deployment_facts,
    read_engine_facts,
)

BASE = "http://target"


async def facts_of(routes: dict[str, Handler], **kwargs: Any) -> tuple[EngineFacts, RecordedTarget]:
    target = RecordedTarget(routes)
    async with mock_client({"target": target}) as client:
        return await read_engine_facts(client, BASE, **kwargs), target


async def test_sglang_single_server_reports_pool_input_limit_and_advertised_context() -> None:
    facts, target = await facts_of(sglang_routes())
    assert facts.engine == "sglang"
    assert facts.model == "Qwen/Qwen2.5-7B-Instruct"
    (side,) = facts.sides
    assert (side.role, side.url) == ("unified", BASE)
    assert side.pool_tokens == 65536
    assert side.max_input_tokens == 65530
    assert side.page_size == 1
    # the server args carry `context_length: null`; the advertised context is /v1/models'
    assert side.context_tokens == facts.context_tokens == 131072
    assert facts.context_source == "openai:/v1/models"
    assert side.source == "sglang:/get_server_info"
    assert side.fields["max_total_num_tokens"] == 65536
    assert "/metrics" not in target.paths()  # the pool was already known
    assert [a.status for a in facts.attempts] == [200, 200]
    assert "pool_tokens=65536" in facts.attempts[0].yielded


async def test_mini_lb_lists_each_side_with_its_own_pool() -> None:
    facts, _ = await facts_of(mini_lb_routes())
    assert facts.engine == "sglang-pd"
    by_role = {s.role: s for s in facts.sides}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["prefill"].pool_tokens == 131072
    assert by_role["decode"].pool_tokens == 1048576
    assert by_role["prefill"].max_input_tokens == 131066
    assert by_role["prefill"].page_size == by_role["decode"].page_size == 64
    assert by_role["prefill"].url == f"{BASE}#prefill[0] (10.0.3.11:30000)"
    assert all(s.context_tokens == 202752 for s in facts.sides)
    assert facts.smallest_pool_side() is by_role["prefill"]


async def test_several_prefill_servers_behind_mini_lb_are_each_a_side() -> None:
    body = fixture_json("sglang_mini_lb_server_info.json")
    second = dict(body["prefill"][0], max_total_num_tokens=65536, port=30002)
    body["prefill"].append(second)
    routes = dict(mini_lb_routes(), **{"GET /get_server_info": json_reply(body)})
    facts, _ = await facts_of(routes)
    pools = [(s.role, s.pool_tokens) for s in facts.sides]
    assert pools == [("prefill", 131072), ("prefill", 65536), ("decode", 1048576)]
    smallest = facts.smallest_pool_side()
    assert smallest is not None
    assert smallest.url.endswith("#prefill[1] (10.0.3.11:30002)")


async def test_per_rank_pools_in_internal_states_count_and_the_smallest_wins() -> None:
    info = fixture_json("sglang_server_info.json")
    del info["max_total_num_tokens"]
    info["internal_states"] = [
        {"dp_rank": 0, "max_total_num_tokens": 40000},
        {"dp_rank": 1, "max_total_num_tokens": 36000},
    ]
    facts, _ = await facts_of({"GET /get_server_info": json_reply(info)})
    assert facts.sides[0].pool_tokens == 36000


async def test_server_info_alias_is_tried_when_the_deprecated_route_is_gone() -> None:
    routes = sglang_routes()
    routes["GET /server_info"] = routes.pop("GET /get_server_info")
    facts, target = await facts_of(routes)
    assert target.paths()[:2] == ["/get_server_info", "/server_info"]
    assert facts.attempts[0].status == 404
    assert facts.sides[0].pool_tokens == 65536
    assert facts.sides[0].source == "sglang:/server_info"


async def test_vllm_pool_is_blocks_times_block_size_from_metrics() -> None:
    facts, target = await facts_of(vllm_routes())
    assert facts.engine == "vllm"
    (side,) = facts.sides
    assert side.pool_tokens == 27000 * 16
    assert side.page_size == 16
    assert side.context_tokens == 131072
    assert side.source == "vllm:/metrics"
    assert side.fields["num_gpu_blocks"] == "27000"
    assert target.paths() == ["/get_server_info", "/server_info", "/v1/models", "/metrics"]
    assert [a.status for a in facts.attempts] == [404, 404, 200, 200]


async def test_vllm_data_parallel_engines_are_each_a_side() -> None:
    metrics = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1024"} 1.0\n'
    )
    routes = dict(vllm_routes(), **{"GET /metrics": text_reply(metrics)})
    facts, _ = await facts_of(routes)
    assert sorted(s.pool_tokens or 0 for s in facts.sides) == [16384, 65536]
    smallest = facts.smallest_pool_side()
    assert smallest is not None
    assert smallest.url == f"{BASE}#engine=1"


async def test_vllm_without_a_block_count_has_an_unknown_pool() -> None:
    metrics = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    routes = dict(vllm_routes(), **{"GET /metrics": text_reply(metrics)})
    facts, _ = await facts_of(routes)
    assert facts.engine == "vllm"
    assert facts.sides[0].pool_tokens is None
    assert facts.sides[0].page_size == 16


async def test_openai_only_server_has_a_context_but_no_pool() -> None:
    facts, _ = await facts_of({"GET /v1/models": json_reply(fixture_json("vllm_models.json"))})
    assert facts.engine == "openai"
    (side,) = facts.sides
    assert side.pool_tokens is None
    assert side.context_tokens == 131072
    assert facts.smallest_pool_side() is None
    assert facts.attempts[-1].describe() == f"GET {BASE}/metrics: HTTP 404: nothing"


async def test_misbehaving_target_is_recorded_never_raised() -> None:
    def timeout(seen: Seen) -> Reply:
        raise httpx.ReadTimeout("timed out")

    facts, _ = await facts_of(
        {
            "GET /get_server_info": text_reply("<html>gateway</html>", content_type="text/html"),
            "GET /server_info": json_reply(["not", "an", "object"]),
            "GET /v1/models": json_reply({"error": "boom"}, status=500),
            "GET /metrics": timeout,
        }
    )
    assert facts.engine == "unknown"
    assert facts.sides == ()
    assert facts.reachable
    assert [a.describe() for a in facts.attempts] == [
        f"GET {BASE}/get_server_info: HTTP 200 (not JSON): nothing",
        f"GET {BASE}/server_info: HTTP 200 (not a JSON object): nothing",
        f"GET {BASE}/v1/models: HTTP 500: nothing",
        f"GET {BASE}/metrics: no response (ReadTimeout: timed out): nothing",
    ]


async def test_unreachable_target_is_tried_once_per_parallel_request_and_then_not_again() -> None:
    async with mock_client({}) as client:
        facts = await read_engine_facts(client, "http://nowhere:1")
    assert not facts.reachable
    assert facts.engine == "unknown"
    tried = [a for a in facts.attempts if a.yielded != "not tried"]
    # the server info and the model list are asked at once; nothing after that is asked
    assert [a.url.rsplit("/", 1)[1] for a in tried] == ["get_server_info", "models"]
    assert all((a.error or "").startswith("unreachable: ConnectError") for a in tried)
    not_tried = [a.url.rsplit("/", 1)[1] for a in facts.attempts if a.yielded == "not tried"]
    assert not_tried == ["metrics"]  # the SGLang alias is not asked after no answer either


async def test_headers_reach_every_request() -> None:
    target = RecordedTarget(sglang_routes())
    async with mock_client({"target": target}) as client:
        await read_engine_facts(client, BASE, headers={"Authorization": "Bearer s3cret"})
    assert target.seen
    assert all(s.headers.get("authorization") == "Bearer s3cret" for s in target.seen)


async def test_reference_engine_identifies_itself() -> None:
    body = fixture_json("sglang_mini_lb_server_info.json")
    body["prefill"][0]["version"] = f"{REFERENCE_ENGINE_VERSION}-0.1.0"
    routes = dict(mini_lb_routes(), **{"GET /get_server_info": json_reply(body)})
    facts, _ = await facts_of(routes)
    assert facts.engine == "kvcanary-reference"
    assert len(facts.sides) == 2


async def test_named_sides_replace_the_routers_list_and_keep_its_context() -> None:
    router = RecordedTarget({"GET /v1/models": json_reply(fixture_json("sglang_models.json"))})
    prefill_info = dict(fixture_json("sglang_server_info.json"), disaggregation_mode="prefill")
    prefill = RecordedTarget({"GET /get_server_info": json_reply(prefill_info)})
    decode = RecordedTarget({"GET /get_server_info": json_reply({"max_total_num_tokens": 500000})})
    hosts = {"router": router, "p": prefill, "d": decode}
    async with mock_client(hosts) as client:
        facts = await read_deployment_facts(
            client, target="http://router", prefill_urls=["http://p/"], decode_urls=["http://d"]
        )
    assert [(s.role, s.url, s.pool_tokens) for s in facts.sides] == [
        ("prefill", "http://p", 65536),
        ("decode", "http://d", 500000),
    ]
    assert all(s.context_tokens == 131072 for s in facts.sides)
    assert facts.context_tokens == 131072
    assert facts.engine == "openai"  # what the router itself is; the sides are SGLang
    assert {a.url.split("/")[2] for a in facts.attempts} == {"router", "p", "d"}


@pytest.mark.parametrize("value", ["12", 12, 12.0])
async def test_figures_may_arrive_as_strings_or_floats(value: object) -> None:
    facts, _ = await facts_of({"GET /get_server_info": json_reply({"max_total_num_tokens": value})})
    assert facts.sides[0].pool_tokens == 12


@pytest.mark.parametrize("value", [None, True, -5, 0, "many", 1.5])
async def test_nonsense_figures_are_unknown(value: object) -> None:
    facts, _ = await facts_of({"GET /get_server_info": json_reply({"max_total_num_tokens": value})})
    assert facts.sides[0].pool_tokens is None


async def test_nothing_is_asked_when_the_flags_gave_the_model_and_the_limits() -> None:
    waits: list[str] = []
    facts, target = await facts_of(
        sglang_routes(), model_known=True, limits_known=True, on_wait=waits.append
    )
    assert target.seen == []
    assert waits == []
    assert facts.attempts == ()
    assert facts.skipped is not None
    assert facts.reachable  # nothing says it is not


async def test_only_the_model_list_is_asked_when_the_limits_were_given() -> None:
    waits: list[str] = []
    facts, target = await facts_of(sglang_routes(), limits_known=True, on_wait=waits.append)
    assert [s.path for s in target.seen] == ["/v1/models"]
    assert facts.model is not None
    assert facts.sides == ()
    assert len(waits) == 1
    assert "/v1/models" in waits[0]


async def test_what_discovery_waits_for_is_told_before_each_round() -> None:
    waits: list[str] = []
    await facts_of(
        {"GET /v1/models": json_reply({"data": [{"id": "m"}]})},
        on_wait=waits.append,
        timeout_s=3.0,  # below the client's own read timeout (httpx: 5 s)
    )
    assert len(waits) == 2
    assert "/get_server_info" in waits[0]
    assert "/v1/models" in waits[0]
    assert "/metrics" in waits[1]
    assert all("3 s" in w for w in waits)


@pytest.mark.parametrize(("client_read_s", "expected_s"), [(2.0, 2.0), (300.0, 10.0), (None, 10.0)])
async def test_each_endpoint_waits_the_shorter_of_ten_seconds_and_the_clients_read_timeout(
    client_read_s: float | None, expected_s: float
) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=client_read_s)) as client:
        assert Fetcher(client, BASE, None).timeout_s == expected_s


@pytest.mark.parametrize("model_id", ["x" * 600, "two\nlines", "", "   ", 7])
async def test_a_model_id_that_is_no_model_name_is_not_taken(model_id: object) -> None:
    card = {"id": model_id, "max_model_len": 4096}
    facts, _ = await facts_of({"GET /v1/models": json_reply({"data": [card]})})
    assert facts.model is None
    assert facts.context_tokens == 4096
