"""`kvcanary run` against small fake targets that each behave like one real failure (or not).

Each target is a safe OpenAI-compatible server (it counts prompt tokens in cl100k_base,
rejects prompts longer than its pool with 400, reports exact usage) except for one thing:

    own_echo     answers with its own prompt's canary words reshuffled and spliced, as a
                 model asked to repeat the text above does: clean
    fragment     quotes 5 consecutive words of an earlier request's canary, without the tag
    zero_width   quotes an earlier canary whole, its words joined by U+200B instead of spaces
    tool_call    puts an earlier canary only in a tool call's arguments
    error_200    answers over-limit prompts with HTTP 200 and vLLM's `{"object": "error"}`
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from fake_openai import (
    CONTEXT,
    POOL,
    Receive,
    Scope,
    Send,
    json_response,
    models_or_404,
    num_prompt_tokens,
    read_body,
    sse_event,
    sse_finish,
    sse_start,
)
from misbehaving_server import serve

from kvcanary.canaries.shape import CANARY_PATTERN
from kvcanary.harness.cli import main

LEAKS = {"cross_tenant_canary", "cross_request_canary"}


def behaving_target(behaviour: str) -> Any:
    seen: list[str] = []  # canaries of earlier prompts, as the target's stale pages hold them
    rng = random.Random(3)

    def answer(prompt: str) -> tuple[str, dict[str, Any] | None]:
        """The text (and a tool call) this target answers `prompt` with."""
        own = [m.group(0) for m in CANARY_PATTERN.finditer(prompt.lower())]
        stale = [c for c in seen if c not in own]
        seen.extend(c for c in own if c not in seen)
        if behaviour == "own_echo" and own:
            words = [w for c in own for w in c.split()[1:]]
            shuffled = rng.sample(words, k=min(6, len(words)))
            spliced = own[0].split()[:4] + own[-1].split()[3:]  # a start joined to a middle
            return f" Sure: ydk {' '.join(shuffled)}. Also {' '.join(spliced)}", None
        if not stale:
            return " word0 word1 word2", None
        victim = stale[-1].split()
        if behaviour == "fragment":
            return f" the text was {' '.join(victim[2:7])} and more", None
        if behaviour == "zero_width":
            return " recalled: " + "\u200b".join(victim), None
        if behaviour == "tool_call":
            call = {"index": 0, "function": {"name": "lookup", "arguments": " ".join(victim)}}
            return "", call
        return " word0 word1 word2", None

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = await read_body(receive)
        if scope["method"] == "GET":
            await models_or_404(scope, send)
            return
        request = json.loads(body)
        num_tokens = num_prompt_tokens(request)
        if num_tokens > POOL:
            error = {"message": f"{num_tokens} tokens is too long", "code": 400}
            if behaviour == "error_200":
                vllm_error = {"object": "error", "type": "BadRequestError", **error}
                await json_response(send, 200, vllm_error)
            else:
                await json_response(send, 400, {"error": error})
            return
        usage = {"prompt_tokens": num_tokens, "completion_tokens": 3}
        if not request.get("stream", True):  # the calibration request: answered at once
            answer_ = {"choices": [{"index": 0, "text": " word"}], "usage": usage}
            await json_response(send, 200, answer_)
            return
        text, call = answer(request["prompt"])
        await sse_start(send)
        await asyncio.sleep(0.002 + num_tokens * 2e-5)  # a prefill that really runs
        if call is not None:
            delta = {"role": "assistant", "tool_calls": [call]}
            await sse_event(send, {"choices": [{"index": 0, "delta": delta}]})
        for start in range(0, len(text), 9):
            await sse_event(send, {"choices": [{"index": 0, "text": text[start : start + 9]}]})
        await sse_finish(send, usage, "stop")

    return app


def run_against(behaviour: str, out: Path) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    with serve(behaving_target(behaviour)) as url:
        status = main(
            ["run", "--target", url, "--pool-tokens", str(POOL), "--context-tokens",
             str(CONTEXT), "--model", "fake", "--requests", "40", "--out", str(out)]
        )  # fmt: skip
    rows = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    return status, rows, json.loads((out / "summary.json").read_text())


def findings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["type"] == "finding"]


def test_an_imperfect_own_echo_is_clean(tmp_path: Path) -> None:
    status, rows, summary = run_against("own_echo", tmp_path)
    assert findings(rows) == []
    assert summary["verdict"] == "clean"
    assert status == 0
    assert any(r["type"] == "own_echo" for r in rows)  # journaled, never a finding


@pytest.mark.parametrize(
    ("behaviour", "field"),
    [
        ("fragment", "text"),
        ("zero_width", "text"),
        ("tool_call", "tool_calls[0].function.arguments"),
    ],
)
def test_partial_disguised_and_tool_call_leaks_are_attributed(
    tmp_path: Path, behaviour: str, field: str
) -> None:
    status, rows, summary = run_against(behaviour, tmp_path)
    found = findings(rows)
    assert found
    assert {f["kind"] for f in found} <= LEAKS
    assert all(f["victim_request_id"] for f in found)  # attributed to the request it came from
    assert summary["verdict"] == "leak"
    assert status == 1
    assert {f["details"]["field"] for f in found} == {field}  # each names where it was
    layer = {"fragment": "fragment", "zero_width": "normalized", "tool_call": "exact"}[behaviour]
    assert {f["details"]["layer"] for f in found} == {layer}


def test_an_error_inside_a_200_is_its_own_finding(tmp_path: Path) -> None:
    status, rows, summary = run_against("error_200", tmp_path)
    assert (summary["verdict"], status) == ("unsafe", 1)  # a protocol defect, not a leak
    kinds = {f["kind"] for f in findings(rows)}
    assert kinds == {"error_in_success"}  # a refusal in the wrong status, not an accept
    assert summary["counts"]["findings"]["error_in_success"] >= 1
    observations = [r for r in rows if r["type"] == "observation" and r["status"] == 200]
    assert any(o["error_kind"] == "error_in_success" for o in observations)
    for name in ("report.html", "report.md", "junit.xml", "summary.json"):  # every output
        assert (tmp_path / name).stat().st_size > 0, name
    assert "UNSAFE" in (tmp_path / "report.md").read_text().splitlines()[0]
