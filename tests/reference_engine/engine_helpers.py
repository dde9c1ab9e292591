"""Small engine configurations and a driver for engine-level tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from reference_engine.config import EngineConfig
from reference_engine.engine import DisaggregatedEngine

TINY_MODEL: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 32,
    "intermediate_size": 64,
}
"""A model small enough for thousands of requests in a test (recall stays exact at 10^3)."""


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
