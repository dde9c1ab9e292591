"""Small engine configurations and a driver for engine-level tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_canaries import Canaries

from kvcanary.canaries import (
    BuiltPrompt,
    CanaryIndex,
    CanaryMinter,
    Owner,
    build_prompt,
    load_tokenizer,
)
from kvcanary.harness.record.events import Limits
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.engine import DisaggregatedEngine, EngineResult

TINY_MODEL: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 32,
    "intermediate_size": 64,
}
"""A model small enough for thousands of requests in a test (recall stays exact at 10^3)."""


def run_limits(config: EngineConfig) -> Limits:
    """The limits `kvcanary run` reads from the bundled engine: the smallest pool and its own
    input limit (SGLang's max_req_input_len), the advertised context, the page size."""
    pool = min(config.prefill_pool_tokens, config.decode_pool_tokens)
    return Limits(
        pool, config.context_length, config.page_size, "engine", config.max_req_input_len(pool)
    )


def small_config(preset: str = "vulnerable", **overrides: Any) -> EngineConfig:
    """A preset at context 1024 (the incident's shape, quick on CPU), fields overridden.

    KVCANARY_TEST_DTYPE=bfloat16 (or float16) runs the engine tests over narrow pools."""
    overrides.setdefault("context_length", 1024)
    overrides.setdefault("dtype", os.environ.get("KVCANARY_TEST_DTYPE", "float32"))
    return EngineConfig.from_preset(preset, **overrides)


async def settle(engine: DisaggregatedEngine, timeout_s: float = 10.0) -> None:
    """Let background work (drains, cancels, conclusions) run until every page is back."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        idle = engine.num_allocated_pages() == 0 and not engine.decode.has_background_work()
        if idle and engine.transfer_is_idle():
            return
        await asyncio.sleep(0.001)


LEAK, ERROR, CLEAN = "leak", "error", "clean"
"""What an engine answer is: a foreign canary in it, an error status without one, or 200
without one."""


def outcome(result: EngineResult, canaries: Canaries, own: str) -> str:
    """LEAK, ERROR or CLEAN for the answer to request `own`."""
    if canaries.foreign(result.text, own):
        return LEAK
    return CLEAN if result.status == 200 else ERROR


async def over_pool(engine: DisaggregatedEngine, canaries: Canaries) -> EngineResult:
    """Four victims (decode's sorted free list wraps around), then the over-pool prompt."""
    for i in range(4):
        victim = canaries.prompt(f"victim{i}", 600, tenant=i + 1)
        result = await engine.generate(engine.request(victim.rid, victim.input_ids, 17))
        assert result.status == 200
        assert canaries.owners(result.text) <= {victim.rid}  # a noisy copy may lose its canary
    attacker = canaries.prompt("attacker", 900)  # prefill's limit is 650, decode's 1018
    result = await engine.generate(engine.request("attacker", attacker.input_ids, 96))
    await settle(engine)
    assert engine.num_allocated_pages() == 0
    return result


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `predicate` while the engine runs; fail the test if it never holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached in time")


FIX_TABLE_PAGE = Path(__file__).parents[2] / "docs" / "explanation" / "reference-engine.md"
MATRIX_HEADER = "| fix alone | over-pool prompt | abort mid-transfer |"
MATRIX_COLUMNS = ("over-pool", "abort")


def readme_matrix_cell(row: str, column: str) -> str:
    """The docs' bug x fix table: the `column` ("over-pool" or "abort") cell of fix `row`
    ("" for the row without a fix)."""
    lines = FIX_TABLE_PAGE.read_text().splitlines()
    start = lines.index(MATRIX_HEADER) + 2
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, *cells = (c.strip() for c in line.strip("|").split("|"))
        if ("" if name == "none" else name.split()[0].strip("`")) == row:
            return cells[MATRIX_COLUMNS.index(column)]
    raise AssertionError(f"the docs' matrix has no row for {row or 'none'!r}")


def laced_prompt(minter: CanaryMinter, tenant: int, num_tokens: int) -> BuiltPrompt:
    """A cl100k prompt of exactly `num_tokens` tokens laced with `tenant`'s canaries."""
    tokenizer = load_tokenizer("cl100k_base")
    return build_prompt(tokenizer, minter, tenant=tenant, request=0, num_tokens=num_tokens)


def canaries_of(minter: CanaryMinter, text: str, built: BuiltPrompt) -> int:
    """How many of `built`'s canaries `text` holds, exact, normalised or as fragments."""
    index = CanaryIndex(minter)
    index.add_many((span.text, Owner("tenant", "request")) for span in built.canaries)
    return len({hit.canary for hit in index.scan(text) if hit.owner is not None})
