"""The in-process engine through its public API: answers, rejections, aborts, introspection."""

from __future__ import annotations

import asyncio

import pytest
from engine_canaries import Canaries
from engine_helpers import settle, small_config, wait_until

from kvcanary.reference_engine.engine import DisaggregatedEngine
from kvcanary.reference_engine.interfaces import GenerateRequest, HeadOut


async def test_a_request_quotes_its_own_prompt_and_drains(canaries: Canaries) -> None:
    async with DisaggregatedEngine(small_config(copy_noise=0.0)) as engine:  # exact quoting
        prompt = canaries.prompt("a", 500)
        result = await engine.generate(engine.request("a", prompt.input_ids, 49))
        assert result.status == 200
        assert len(result.token_ids) == 49
        assert result.finish.reason == "length"
        assert result.finish.prompt_tokens == 500
        assert (result.prefill_finish.status, result.prefill_finish.prompt_tokens) == (200, 500)
        assert set(result.token_ids) <= set(prompt.input_ids)
        assert canaries.owners(result.text) == {"a"}
        assert result.ttft_s is not None
        await settle(engine)
        assert engine.num_allocated_pages() == 0


async def test_concurrent_requests_are_batched_and_each_quotes_only_itself(
    canaries: Canaries,
) -> None:
    async with DisaggregatedEngine(small_config(prefill_chunk_tokens=128)) as engine:
        prompts = [canaries.prompt(f"t{i}", 100 + 60 * i) for i in range(6)]
        results = await asyncio.gather(
            *(engine.generate(engine.request(p.rid, p.input_ids, 40)) for p in prompts)
        )
        for prompt, result in zip(prompts, results, strict=True):
            assert result.status == 200
            assert canaries.owners(result.text) == {prompt.rid}
        await settle(engine)
        assert engine.num_allocated_pages() == 0


@pytest.mark.parametrize(
    ("num_tokens", "max_new", "message"),
    [
        (1024, 8, "The input (1024 tokens) is longer than the model's context length (1024"),
        (1000, 30, "Requested token count exceeds the model's maximum context length of 1024"),
    ],
)
async def test_context_violations_get_sglang_400s_on_both_sides(
    canaries: Canaries, num_tokens: int, max_new: int, message: str
) -> None:
    async with DisaggregatedEngine(small_config()) as engine:
        prompt = canaries.prompt("x", num_tokens)
        result = await engine.generate(engine.request("x", prompt.input_ids, max_new))
        assert result.status == 400
        assert result.token_ids == ()
        assert result.finish.error is not None
        assert result.finish.error["type"] == "BadRequestError"
        assert result.finish.error["code"] == 400
        assert result.finish.error["message"].startswith(message)
        assert result.prefill_finish.status == 400
        await settle(engine)
        assert engine.num_allocated_pages() == 0


async def test_bad_token_ids_and_empty_prompts_are_400s() -> None:
    async with DisaggregatedEngine(small_config()) as engine:
        for ids in ([5, 10**7], []):
            result = await engine.generate(engine.request("bad", ids, 4))
            assert result.status == 400


async def test_abort_while_decoding_answers_499_and_frees_pages(canaries: Canaries) -> None:
    async with DisaggregatedEngine(small_config()) as engine:
        prompt = canaries.prompt("a", 300)
        task = asyncio.create_task(engine.generate(engine.request("a", prompt.input_ids, 400)))
        await wait_until(lambda: bool(engine.decode.scheduler.running))
        await engine.abort("a")
        result = await task
        assert result.status == 499
        assert 0 < len(result.token_ids) < 400
        await settle(engine)
        assert engine.num_allocated_pages() == 0


async def test_a_disconnect_mid_stream_aborts_on_both_sides(canaries: Canaries) -> None:
    async with DisaggregatedEngine(small_config()) as engine:
        prompt = canaries.prompt("a", 300)
        req = GenerateRequest("a", tuple(prompt.input_ids), 400, bootstrap_room=77)
        prefill = asyncio.create_task(engine.prefill.generate(req))
        stream = engine.decode.generate(req)
        assert isinstance(await anext(stream), HeadOut)  # the reservation is published
        first = await anext(stream)
        assert first.token_id in prompt.input_ids  # type: ignore[union-attr]
        await stream.aclose()  # the client went away
        await prefill
        await settle(engine)
        assert engine.num_allocated_pages() == 0
        assert engine.decode.scheduler.find("a") is None


async def test_stop_finishes_live_requests_and_returns_their_pages(
    canaries: Canaries,
) -> None:
    engine = DisaggregatedEngine(small_config())
    await engine.start()
    prompt = canaries.prompt("a", 300)
    task = asyncio.create_task(engine.generate(engine.request("a", prompt.input_ids, 600)))
    await wait_until(lambda: bool(engine.decode.scheduler.running))
    await engine.stop()
    result = await task
    assert result.status == 500
    assert engine.num_allocated_pages() == 0


def test_server_info_and_metrics_use_sglang_names() -> None:
    engine = DisaggregatedEngine(small_config())
    prefill, decode = engine.prefill.server_info(), engine.decode.server_info()
    assert prefill["disaggregation_mode"] == "prefill"
    assert (prefill["max_total_num_tokens"], prefill["max_req_input_len"]) == (656, 650)
    assert (decode["max_total_num_tokens"], decode["max_req_input_len"]) == (2048, 1018)
    assert prefill["context_length"] == decode["context_length"] == 1024
    assert decode["kvcanary_reference_engine"] is True
    assert decode["internal_states"][0]["num_allocated_pages"] == 0
    assert decode["fixes"] == []
    metrics = engine.decode.metrics_snapshot()
    assert metrics["token_usage"] == 0.0
    assert metrics["num_transfer_failed_reqs_total"] == 0.0
    assert engine.tokenizer.vocab_size == 100277
