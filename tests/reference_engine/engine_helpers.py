"""Small engine configurations and a driver for engine-level tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from kvcanary.reference_engine.engine import DisaggregatedEngine

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


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `predicate` while the engine runs; fail the test if it never holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached in time")


README = Path(__file__).parents[2] / "README.md"
MATRIX_HEADER = "| fix alone | over-pool prompt | abort mid-transfer |"
MATRIX_COLUMNS = ("over-pool", "abort")


def readme_matrix_cell(row: str, column: str) -> str:
    """README's bug x fix table: the `column` ("over-pool" or "abort") cell of fix `row`
    ("" for the row without a fix)."""
    lines = README.read_text().splitlines()
    start = lines.index(MATRIX_HEADER) + 2
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, *cells = (c.strip() for c in line.strip("|").split("|"))
        if ("" if name == "none" else name.split()[0].strip("`")) == row:
            return cells[MATRIX_COLUMNS.index(column)]
    raise AssertionError(f"README's matrix has no row for {row or 'none'!r}")


def laced_prompt(minter: CanaryMinter, tenant: int, num_tokens: int) -> BuiltPrompt:
    """A cl100k prompt of exactly `num_tokens` tokens laced with `tenant`'s canaries."""
    tokenizer = load_tokenizer("cl100k_base")
    return build_prompt(tokenizer, minter, tenant=tenant, request=0, num_tokens=num_tokens)


def canaries_of(minter: CanaryMinter, text: str, built: BuiltPrompt) -> int:
    """How many of `built`'s canaries `text` holds, exact, normalised or as fragments."""
    index = CanaryIndex(minter)
    index.add_many((span.text, Owner("tenant", "request")) for span in built.canaries)
    return len({hit.canary for hit in index.scan(text) if hit.owner is not None})
