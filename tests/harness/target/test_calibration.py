"""Calibration of the special tokens a server adds, and the protocol detector using it: a
server that prepends a BOS token is not a mismatch; one that reports usage 1 for a
3000-token prompt still is."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from recorded_targets import Handler, RecordedTarget, Reply, Seen, mock_client
from word_tokenizer import WordTokenizer

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.record.events import Limits
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.target.calibration import (
    CALIBRATION_TEXT,
    Calibrator,
    PromptTokenOffset,
    TokenizerMismatch,
    calibrate,
    measure_prompt_token_offset,
)
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant

BASE = "http://target"
TENANT = Tenant(name="tenant-0")
LIMITS = Limits(pool_tokens=8192, context_tokens=8192, page_size=16, source="flags")


def completions(*, num_special: int, placeholder_above: int | None = None) -> Handler:
    """A completions route that counts `num_special` extra tokens (a BOS) on every prompt and,
    with `placeholder_above`, reports 1 for longer prompts (the incident's signature)."""

    def answer(seen: Seen) -> Reply:
        body = json.loads(seen.body)
        text = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
        num_tokens = len(text.split()) + num_special
        if placeholder_above is not None and num_tokens > placeholder_above:
            num_tokens = 1
        reply = {
            "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": num_tokens, "completion_tokens": 1},
        }
        return 200, "application/json", json.dumps(reply).encode()

    return answer


def plan(num_words: int) -> RequestPlan:
    return RequestPlan(
        request_id=f"t0-r{num_words:06d}",
        tenant=TENANT.name,
        phase="fill",
        intent="victim",
        size_label="fill",
        num_prompt_tokens=num_words,
        expected="accept",
        api="completions",
        prompt=" word" * num_words,
        max_tokens=1,
    )


async def findings_against(handler: Handler, num_words: int) -> tuple[int, list[FindingKind], str]:
    target = RecordedTarget({"POST /v1/completions": handler})
    async with mock_client({"target": target}) as http:
        measured = await measure_prompt_token_offset(
            http, BASE, "m", "completions", WordTokenizer(), TENANT
        )
        detector = ProtocolDetector(LIMITS, prompt_token_offsets={"completions": measured.offset})
        client = TargetClient(http, BASE, model="m", stream=False)
        one = plan(num_words)
        obs = await client.send(one, TENANT, t_scheduled_ns=0)
    findings = detector.check(one, obs)
    summaries = " ".join(f.summary for f in findings)
    return measured.offset, [f.kind for f in findings], summaries


async def test_a_server_that_adds_a_bos_token_is_not_a_mismatch() -> None:
    offset, kinds, _ = await findings_against(completions(num_special=1), 3000)
    assert offset == 1
    assert kinds == []


async def test_without_calibration_the_bos_token_would_be_a_mismatch() -> None:
    # the same answer, compared without the offset: what every run reported before
    target = RecordedTarget({"POST /v1/completions": completions(num_special=1)})
    async with mock_client({"target": target}) as http:
        obs = await TargetClient(http, BASE, model="m", stream=False).send(
            plan(30), TENANT, t_scheduled_ns=0
        )
    (finding,) = ProtocolDetector(LIMITS).check(plan(30), obs)
    assert finding.details["difference"] == 1


async def test_usage_1_for_a_3000_token_prompt_is_a_mismatch_naming_the_offset() -> None:
    handler = completions(num_special=1, placeholder_above=2048)
    offset, kinds, summary = await findings_against(handler, 3000)
    assert offset == 1
    assert kinds == [FindingKind.PROMPT_TOKENS_MISMATCH]
    assert "usage.prompt_tokens=1" in summary
    assert "+1 token(s) the server adds to every completions prompt" in summary


async def test_the_calibration_request_is_short_and_shaped_like_a_plan() -> None:
    target = RecordedTarget({"POST /v1/chat/completions": completions(num_special=5)})
    async with mock_client({"target": target}) as http:
        measured = await measure_prompt_token_offset(
            http, BASE, "m", "chat", WordTokenizer(), TENANT, chat_overhead_tokens=5
        )
    assert measured.offset == 0  # the template's 5 tokens were already counted
    assert measured.num_counted == len(CALIBRATION_TEXT.split()) + 5
    (seen,) = target.seen
    body = json.loads(seen.body)
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert body["messages"][0]["content"] == CALIBRATION_TEXT
    assert measured.to_dict()["offset"] == 0


async def test_an_answer_without_usage_measures_nothing() -> None:
    def no_usage(seen: Seen) -> Reply:
        return 200, "application/json", b'{"choices": [{"text": "x"}]}'

    target = RecordedTarget({"POST /v1/completions": no_usage})
    async with mock_client({"target": target}) as http:
        measured = await measure_prompt_token_offset(
            http, BASE, "m", "completions", WordTokenizer(), TENANT
        )
    assert (measured.num_reported, measured.offset) == (None, 0)
    assert "reported no usage" in measured.describe()


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (completions(num_special=-3), r"counts \d+ prompt tokens where --tokenizer words"),
        (lambda seen: (503, "text/plain", b"CB worker is dead"), "answered HTTP 503"),
        (lambda seen: (200, "text/html", b"<html>"), "answered 200 without JSON"),
    ],
)
async def test_an_unusable_calibration_is_one_line(handler: Handler, message: str) -> None:
    target = RecordedTarget({"POST /v1/completions": handler})
    async with mock_client({"target": target}) as http:
        with pytest.raises(ConfigError, match=message) as caught:
            await measure_prompt_token_offset(
                http, BASE, "m", "completions", WordTokenizer(), TENANT
            )
    assert "\n" not in str(caught.value)


def usage_of(count: Callable[[int], int]) -> Handler:
    """A completions route reporting `count(words)` prompt tokens; 400 past 2000 words."""

    def answer(seen: Seen) -> Reply:
        body = json.loads(seen.body)
        text = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
        num_words = len(text.split())
        if num_words > 2000:
            return 400, "application/json", b'{"error": {"message": "too long"}}'
        reply = {
            "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": count(num_words), "completion_tokens": 1},
        }
        return 200, "application/json", json.dumps(reply).encode()

    return answer


async def calibrated(
    handler: Handler, *, api: ApiStyle = "completions", limit_tokens: int = 8192
) -> tuple[PromptTokenOffset | None, list[str], list[Seen]]:
    target = RecordedTarget({f"POST /v1/{'chat/' if api == 'chat' else ''}completions": handler})
    notes: list[str] = []
    async with mock_client({"target": target}) as http:
        requests = Calibrator(http, BASE, "m", api, WordTokenizer(), TENANT, 0)
        result = await calibrate(requests, limit_tokens=limit_tokens, note=notes.append)
    return result, notes, target.seen


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_a_constant_offset_is_confirmed_at_two_lengths_and_corrected(api: ApiStyle) -> None:
    """A chat template or a BOS adds the same tokens to every prompt: corrected."""
    result, notes, seen = await calibrated(usage_of(lambda words: words + 6), api=api)
    assert result is not None
    assert result.offset == 6
    assert len(seen) == 2
    assert result.longer is not None
    counted, reported = result.longer
    assert reported - counted == 6
    assert counted > 10 * result.num_counted  # a few hundred tokens against some twenty
    (note,) = notes
    assert note.startswith(f"calibration: {api}: the server counts +6 token(s) on every prompt")
    assert f"{reported} for {counted}" in note
    assert result.to_dict()["longer"] == (counted, reported)


async def test_a_count_that_grows_differently_with_length_stops_the_run_in_one_line() -> None:
    """vLLM counted with the model's tokenizer, kvcanary with cl100k_base: "30 for 24"
    looked like a constant +6, and every answer then read as a prompt_tokens_mismatch."""
    with pytest.raises(TokenizerMismatch) as caught:
        await calibrated(usage_of(lambda words: words * 5 // 4 + 1))
    message = str(caught.value)
    assert "\n" not in message
    assert "--tokenizer PATH/tokenizer.json" in message
    assert "counts prompts differently from --tokenizer words" in message
    assert "the difference changes with the length" in message
    assert isinstance(caught.value, ConfigError)  # exit 2, a configuration error


async def test_a_longer_prompt_that_cannot_be_sent_leaves_one_length() -> None:
    result, notes, _ = await calibrated(usage_of(lambda words: words + 1), limit_tokens=100)
    assert result is not None
    assert (result.offset, result.longer) == (1, None)
    assert "one length only: a limit of 100 tokens leaves no room" in notes[0]

    def refusing_above(num_bytes: int) -> Handler:
        def answer(seen: Seen) -> Reply:
            if len(seen.body) > num_bytes:
                return 400, "application/json", b'{"error": {"message": "too long"}}'
            return usage_of(lambda words: words + 1)(seen)

        return answer

    # refused: halved until it fits (a wrong tokenizer undercounts the limit)
    result, notes, seen = await calibrated(refusing_above(1000))
    assert result is not None
    assert result.longer is not None
    assert len(seen) > 2
    # refused at every length past the short one
    result, notes, _ = await calibrated(refusing_above(300))
    assert result is not None
    assert (result.offset, result.longer) == (1, None)
    assert "(one length only: calibration request to http://target" in notes[0]


async def test_a_large_offset_seen_at_one_length_only_is_not_corrected() -> None:
    result, notes, _ = await calibrated(usage_of(lambda words: words + 40), limit_tokens=100)
    assert result is None
    assert "more than 16 tokens is no tokenizer convention" in notes[0]


async def test_an_unanswered_calibration_applies_no_offset() -> None:
    result, notes, _ = await calibrated(lambda seen: (503, "text/plain", b"busy"))
    assert result is None
    assert notes[0].startswith("calibration: not measured (calibration request to ")
    assert "answered HTTP 503" in notes[0]
