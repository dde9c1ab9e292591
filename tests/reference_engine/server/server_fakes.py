"""Test doubles of the engine core's sides, for HTTP-layer tests that must not depend on it.

`FakePrefill` and `FakeDecode` follow the `PrefillSide` / `DecodeSide` protocols with a
page counter instead of a pool: decode owns `ceil(len(input_ids) / page_size)` pages while
it streams, frees them when it finishes or is aborted, and rejects prompts over its pool
with a 400 `FinishOut` before any token. Each token is the prompt's next token, so a
response echoes its prompt. Every request each side received is recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvcanary.reference_engine.interfaces import FinishOut, GenerateRequest, TokenOut
from kvcanary.reference_engine.server.errors import error_body
from kvcanary.reference_engine.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True)
class FakeConfig:
    context_length: int = 512
    page_size: int = 16
    decode_pool_tokens: int = 256


class _FakeSide:
    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.received: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.started = False
        self.pages: dict[str, int] = {}

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    def server_info(self) -> dict[str, Any]:
        return {"max_total_num_tokens": self.config.decode_pool_tokens, "max_req_input_len": 250}

    def metrics_snapshot(self) -> dict[str, float]:
        return {
            "token_usage": self.num_allocated_pages() * self.config.page_size / 256,
            "num_running_reqs": float(len(self.pages)),
            "num_queue_reqs": 0.0,
            "num_transfer_failed_reqs_total": 0.0,
            "num_bootstrap_failed_reqs_total": 0.0,
        }

    def num_allocated_pages(self) -> int:
        return sum(self.pages.values())

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


class FakePrefill(_FakeSide):
    """Answers `length` with the prompt length, after `delay_s`."""

    delay_s = 0.0
    reported_prompt_tokens: int | None = None
    """Report this instead of the prompt's length (the vulnerable placeholder's 1)."""

    async def generate(self, req: GenerateRequest) -> FinishOut:
        self.received.append(req)
        await asyncio.sleep(self.delay_s)
        prompt_tokens = self.reported_prompt_tokens or len(req.input_ids)
        return FinishOut("length", 200, prompt_tokens, 0)


class FakeDecode(_FakeSide):
    """Echoes the prompt token by token, `token_delay_s` apart."""

    token_delay_s = 0.0
    fail_after_tokens: int | None = None
    """Finish with a 500 after this many tokens (an error after the stream started)."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenOut | FinishOut]:
        self.received.append(req)
        n = len(req.input_ids)
        if n > self.config.decode_pool_tokens:
            message = f"Request {req.rid} exceeds the maximum number of tokens: {n} > 256"
            yield FinishOut("abort", 400, n, 0, error=error_body(message, 400))
            return
        self.pages[req.rid] = -(-n // self.config.page_size)
        tokenizer = load_tokenizer()
        num_out = 0
        try:
            for token_id in req.input_ids[: req.max_new_tokens]:
                if req.rid in self.aborted:
                    yield FinishOut("abort", 200, n, num_out)
                    return
                if self.fail_after_tokens is not None and num_out >= self.fail_after_tokens:
                    error = error_body("KV transfer failed", 500)
                    yield FinishOut("abort", 500, n, num_out, error=error)
                    return
                await asyncio.sleep(self.token_delay_s)
                num_out += 1
                yield TokenOut(token_id, tokenizer.decode([token_id]))
            reason = "length" if num_out == req.max_new_tokens else "stop"
            yield FinishOut(reason, 200, n, num_out, cached_tokens=min(n, 3))
        finally:
            self.pages.pop(req.rid, None)


@dataclass
class FakeEngine:
    """The router over a fake prefill and decode, and a client for it (`conftest`)."""

    client: httpx.AsyncClient
    prefill: FakePrefill
    decode: FakeDecode
