"""The prefix cache inside the prefill side: skipped compute, real KV, salts, eviction, aborts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from engine_helpers import TINY_MODEL, settle, small_config

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.engine import DisaggregatedEngine, EngineResult, new_room
from kvcanary.reference_engine.finish import client_aborted
from kvcanary.reference_engine.interfaces import GenerateRequest, TransferMetadata
from kvcanary.reference_engine.prefill_scheduler import CACHE_OWNER, PrefillScheduler
from kvcanary.reference_engine.sequence import Req

P = 16  # page size of small_config


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50_000) for _ in range(n)]


def config(*fixes: str, prefix_cache: bool = True, **overrides: object) -> EngineConfig:
    return small_config(
        "vulnerable", fixes=frozenset(fixes), prefix_cache=prefix_cache, **TINY_MODEL, **overrides
    )


class ChunkLog:
    """Records the token ranges the prefill model really computes."""

    def __init__(self, engine: DisaggregatedEngine) -> None:
        self.ranges: list[tuple[int, int]] = []
        runner = engine.prefill.runner
        original = runner.prefill_chunk

        def prefill_chunk(req: Req, start: int, end: int) -> int | None:
            self.ranges.append((start, end))
            return original(req, start, end)

        runner.prefill_chunk = prefill_chunk  # type: ignore[method-assign]

    def computed_since(self, mark: int) -> int:
        return sum(end - start for start, end in self.ranges[mark:])


async def send(
    engine: DisaggregatedEngine,
    rid: str,
    prompt: Sequence[int],
    *,
    max_new_tokens: int = 1,
    cache_salt: str | None = None,
    tenant_key: str | None = None,
) -> EngineResult:
    req = GenerateRequest(
        rid,
        tuple(prompt),
        max_new_tokens,
        new_room(),
        cache_salt=cache_salt,
        tenant_key=tenant_key,
    )
    result = await engine.generate(req)
    assert result.status == 200, result.finish
    return result


async def test_a_shared_prefix_skips_its_prefill_and_its_kv_is_the_real_one() -> None:
    prefix = ids(1, 5 * P)
    first, second = prefix + ids(2, 20), prefix + ids(3, 20)
    async with DisaggregatedEngine(config()) as cold:
        expected = await send(cold, "alone", second, max_new_tokens=24)
    async with DisaggregatedEngine(config()) as engine:
        log = ChunkLog(engine)
        await send(engine, "first", first)
        mark = len(log.ranges)
        hit = await send(engine, "second", second, max_new_tokens=24)

        assert log.computed_since(mark) == len(second) - 5 * P  # only the suffix
        assert hit.finish.cached_tokens == 5 * P
        assert hit.prefill_finish.cached_tokens == 5 * P
        assert hit.finish.prompt_tokens == len(second)
        # the recall head quotes scheduled positions of the prompt, cached pages included
        assert hit.token_ids == expected.token_ids
        assert expected.finish.cached_tokens == 0
        await settle(engine)
        assert engine.num_allocated_pages() == 0
        assert engine.prefill.scheduler.num_cached_pages == (len(first) // P) + 1
        engine.prefill.allocator.check_consistent()


async def test_a_fully_cached_prompt_still_computes_its_last_page() -> None:
    prompt = ids(4, 8 * P)
    async with DisaggregatedEngine(config()) as engine:
        log = ChunkLog(engine)
        cold = await send(engine, "cold", prompt, max_new_tokens=12)
        mark = len(log.ranges)
        warm = await send(engine, "warm", prompt, max_new_tokens=12)

        assert warm.finish.cached_tokens == 7 * P
        assert log.ranges[mark:] == [(7 * P, 8 * P)]
        assert warm.token_ids == cold.token_ids


async def test_the_cache_is_off_unless_configured() -> None:
    prompt = ids(5, 6 * P)
    async with DisaggregatedEngine(config(prefix_cache=False)) as engine:
        log = ChunkLog(engine)
        await send(engine, "one", prompt)
        mark = len(log.ranges)
        again = await send(engine, "two", prompt)

        assert again.finish.cached_tokens == 0
        assert log.computed_since(mark) == len(prompt)
        assert engine.prefill.scheduler.cache is None


# (fixes, first sender (salt, tenant key), second sender, whether the second hits)
ISOLATION = [
    ((), ("s-a", "key-a"), ("s-b", "key-b"), True),  # no fix: salts are ignored
    (("cache_salt",), ("s-a", "key-a"), ("s-b", "key-b"), False),
    (("cache_salt",), ("s-a", "key-a"), ("s-a", "key-b"), True),  # a spoofed salt works
    (("cache_salt",), (None, "key-a"), (None, "key-b"), True),  # unsalted tenants share
    (("derive_cache_salt",), (None, "key-a"), (None, "key-b"), False),
    (("derive_cache_salt", "cache_salt"), ("s-a", "key-a"), ("s-a", "key-b"), False),
    (("derive_cache_salt", "cache_salt"), ("s-a", "key-a"), ("s-a", "key-a"), True),
    (("derive_cache_salt", "cache_salt"), ("s-a", "key-a"), ("s-x", "key-a"), False),
]


@pytest.mark.parametrize(("fixes", "owner", "other", "hit"), ISOLATION)
async def test_salts_and_credentials_select_the_cache_namespace(
    fixes: tuple[str, ...],
    owner: tuple[str | None, str | None],
    other: tuple[str | None, str | None],
    hit: bool,
) -> None:
    prefix = ids(6, 4 * P)
    async with DisaggregatedEngine(config(*fixes)) as engine:
        await send(engine, "a", prefix + ids(7, 9), cache_salt=owner[0], tenant_key=owner[1])
        result = await send(
            engine, "b", prefix + ids(8, 9), cache_salt=other[0], tenant_key=other[1]
        )
    assert result.finish.cached_tokens == (4 * P if hit else 0)


async def test_a_full_pool_evicts_least_recently_used_cached_pages() -> None:
    # prefill pool of 41 pages; each prompt needs 19, so the cache keeps only the latest ones
    prompts = [ids(100 + k, 300) for k in range(6)]
    async with DisaggregatedEngine(config()) as engine:
        for k, prompt in enumerate(prompts):
            result = await send(engine, f"p{k}", prompt)
            assert result.finish.cached_tokens == 0
            engine.prefill.allocator.check_consistent()
            engine.prefill.scheduler.cache.check_consistent()  # type: ignore[union-attr]
        latest = await send(engine, "latest-again", prompts[-1])
        oldest = await send(engine, "oldest-again", prompts[0])
        await settle(engine)

        assert latest.finish.cached_tokens == 18 * P
        assert oldest.finish.cached_tokens == 0
        assert engine.num_allocated_pages() == 0
        allocator = engine.prefill.allocator
        assert allocator.num_allocated_pages == engine.prefill.scheduler.num_cached_pages
        assert set(allocator.owned_pages(CACHE_OWNER)) == set(
            engine.prefill.scheduler.cache.page_ids()  # type: ignore[union-attr]
        )


def _prefilled(scheduler: PrefillScheduler, rid: str, prompt: list[int]) -> Req:
    req = Req.from_request(GenerateRequest(rid, tuple(prompt), 8, hash(rid) % 1000))
    scheduler.add(req)
    scheduler.on_bootstrapped(req, TransferMetadata(req.room, tuple(range(1, 20)), len(prompt)))
    while not scheduler.prefill_done(req):
        scheduled = scheduler.schedule()
        assert scheduled is not None
        _, _, end = scheduled
        scheduler.on_chunk_done(req, end, 42 if end == len(prompt) else None)
    return req


def test_aborted_requests_are_never_inserted() -> None:
    scheduler = PrefillScheduler(config())
    prompt = ids(9, 4 * P)

    aborted = _prefilled(scheduler, "aborted", prompt)
    scheduler.finish_failed(aborted, client_aborted("aborted"))
    assert scheduler.num_cached_pages == 0
    assert scheduler.allocator.num_allocated_pages == 0

    done = _prefilled(scheduler, "done", prompt)
    done_pages = list(done.page_ids)
    assert done.num_cached_tokens == 0
    scheduler.finish_success(done)
    assert scheduler.num_cached_pages == 4
    assert scheduler.allocator.owned_pages(CACHE_OWNER) == sorted(done_pages)

    again = _prefilled(scheduler, "again", prompt)
    assert again.num_cached_tokens == 3 * P
    assert again.page_ids[:3] == done_pages[:3]
    scheduler.finish_failed(again, client_aborted("again"))  # releases its lock and own page
    assert scheduler.num_cached_pages == 4
    assert scheduler.allocator.num_allocated_pages == 4
    assert scheduler.cache is not None
    assert scheduler.cache.num_evictable_pages == 4
