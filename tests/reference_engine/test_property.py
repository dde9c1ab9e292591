"""Randomized schedules: many mixed requests (sizes over every limit, aborts, disconnects).

On the hardened preset no answer may contain another request's canary, no page may be owned
twice (the allocator asserts it on every allocation; `check_consistent` audits the lists) and
every page is free once the engine drains. The same schedule on the vulnerable preset must
produce leaks, which shows the check can fail.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from engine_canaries import Canaries
from engine_helpers import TINY_MODEL, settle, small_config

from kvcanary.reference_engine.engine import DisaggregatedEngine
from kvcanary.reference_engine.tokenizer import Tokenizer

CONTEXT = 256


@dataclass(frozen=True, slots=True)
class Planned:
    rid: str
    num_tokens: int
    max_new: int
    ending: str  # "normal" | "abort" | "disconnect"
    after_yields: int


def plan(rng: random.Random, num_requests: int) -> list[Planned]:
    planned = []
    for i in range(num_requests):
        num_tokens = rng.choice(
            [rng.randint(1, 150), rng.randint(150, CONTEXT - 1), rng.randint(CONTEXT, 320)]
        )
        ending = rng.choices(["normal", "abort", "disconnect"], weights=[6, 2, 2])[0]
        after = rng.choice([rng.randint(0, 30), rng.randint(30, 300), rng.randint(300, 3000)])
        planned.append(Planned(f"r{i}", num_tokens, rng.randint(1, 40), ending, after))
    return planned


@dataclass(slots=True)
class Tally:
    num_ok: int = 0
    num_errors: int = 0
    num_cut: int = 0
    num_leaks: int = 0


async def run_schedule(tokenizer: Tokenizer, preset: str, seed: int, num_requests: int) -> Tally:
    config = small_config(
        preset,
        context_length=CONTEXT,
        prefill_chunk_tokens=64,
        transfer_chunk_pages=2,
        max_running_requests=12,
        seed=seed,
        **TINY_MODEL,
    )
    canaries, tally = Canaries(tokenizer, seed), Tally()
    slots = asyncio.Semaphore(16)
    async with DisaggregatedEngine(config) as engine:

        async def one(p: Planned) -> None:
            prompt = canaries.prompt(p.rid, p.num_tokens, tenant=int(p.rid[1:]) % 5)
            async with slots:
                task = asyncio.create_task(
                    engine.generate(engine.request(p.rid, prompt.input_ids, p.max_new))
                )
                if p.ending != "normal":
                    for _ in range(p.after_yields):
                        await asyncio.sleep(0)
                    if p.ending == "abort":
                        await engine.abort(p.rid)
                    else:
                        task.cancel()
                try:
                    result = await task
                except asyncio.CancelledError:
                    tally.num_cut += 1
                    return
            if canaries.foreign(result.text, p.rid):
                tally.num_leaks += 1
            elif result.status == 200:
                tally.num_ok += 1
            else:
                tally.num_errors += 1
            engine.prefill.allocator.check_consistent()
            engine.decode.allocator.check_consistent()

        await asyncio.gather(*(one(p) for p in plan(random.Random(seed), num_requests)))
        await settle(engine)
        assert engine.prefill.crash is None
        assert engine.decode.crash is None
        assert engine.num_allocated_pages() == 0
        assert engine.transfer_is_idle()
        engine.prefill.allocator.check_consistent()
        engine.decode.allocator.check_consistent()
    return tally


@pytest.mark.parametrize("seed", [1, 2])
async def test_hardened_never_leaks_and_always_drains(tokenizer: Tokenizer, seed: int) -> None:
    tally = await run_schedule(tokenizer, "hardened", seed, num_requests=500)
    assert tally.num_leaks == 0
    assert tally.num_ok > 250
    assert tally.num_errors > 25  # the over-limit sizes were really tried


async def test_the_same_schedules_leak_on_the_vulnerable_preset(tokenizer: Tokenizer) -> None:
    tally = await run_schedule(tokenizer, "vulnerable", seed=1, num_requests=300)
    assert tally.num_leaks > 0
