"""Limits discovery: the pool, context and page size a run's workload is sized against.

Flags win. When both `--pool-tokens` and `--context-tokens` are given no request is made;
otherwise the missing figures are read from the target (`harness.target.server_info`). For a
disaggregated deployment the pool to test against is the *smallest* across sides: a prompt
longer than the prefill pool but shorter than decode's is exactly the incident's prompt, and
`Limits.source` says which side the figure came from. The page size defaults to 16 when
neither a flag nor the target says otherwise (docs/explanation/canaries.md); a target page smaller
than 16 (SGLang's non-PD default is 1) is laced for 16 too, the densest lacing canaries of
at most 8 tokens allow, and the source says so. A page size given as a flag is used as given.

The engine's answer to a prompt that fits the context while prompt + max_tokens does not
(`Limits.max_tokens_policy`) comes with them, by the engine the target was identified as.

What it deliberately does not do: guess. A pool it could not read is a `ConfigError` naming
what was tried and the flags that would supply it; a target that answered nothing at all is a
`RunIncomplete` (exit 3), because no flag makes an unreachable target testable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import httpx

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.record.events import Limits
from kvcanary.harness.target.discovery_fetch import DISCOVERY_TIMEOUT_S
from kvcanary.harness.target.engine_shapes import max_tokens_policy
from kvcanary.harness.target.server_info import EngineFacts, SideFacts, read_engine_facts

DEFAULT_PAGE_SIZE = 16


async def discover_limits(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    pool_tokens: int | None,
    context_tokens: int | None,
    page_size: int | None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = DISCOVERY_TIMEOUT_S,
    on_wait: Callable[[str], None] | None = None,
) -> Limits:
    """The limits to size a run against: flags first, then what the target reports
    (`timeout_s` bounds each endpoint; `on_wait` hears what is being waited for)."""
    for name, value in (
        ("--pool-tokens", pool_tokens),
        ("--context-tokens", context_tokens),
        ("--page-size", page_size),
    ):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be a positive number of tokens, got {value}")
    if pool_tokens is not None and context_tokens is not None:
        return Limits(pool_tokens, context_tokens, page_size or DEFAULT_PAGE_SIZE, "flags")
    facts = await read_engine_facts(
        client, base_url, headers=headers, timeout_s=timeout_s, on_wait=on_wait
    )
    return limits_from_facts(
        facts, pool_tokens=pool_tokens, context_tokens=context_tokens, page_size=page_size
    )


def limits_from_facts(
    facts: EngineFacts,
    *,
    pool_tokens: int | None = None,
    context_tokens: int | None = None,
    page_size: int | None = None,
) -> Limits:
    """Combine flags with facts already read; raise when a figure is still missing."""
    side = facts.smallest_pool_side()
    pool = pool_tokens if pool_tokens is not None else (side.pool_tokens if side else None)
    context = context_tokens if context_tokens is not None else facts.context_tokens
    if pool is None or context is None:
        if not facts.reachable:
            raise RunIncomplete(
                f"target {facts.base_url} is unreachable, so its limits cannot be read: "
                + _tried(facts)
            )
        missing = [
            flag
            for flag, value in (("--pool-tokens N", pool), ("--context-tokens N", context))
            if value is None
        ]
        raise ConfigError(
            f"could not read the target's {_figures(pool, context)} from {facts.base_url} "
            f"({_tried(facts)}); pass {' and '.join(missing)}"
        )
    reported = (side.page_size if side and side.page_size else None) or facts.page_size
    page = page_size or max(reported or DEFAULT_PAGE_SIZE, DEFAULT_PAGE_SIZE)
    return Limits(
        pool_tokens=pool,
        context_tokens=context,
        page_size=page,
        source=_source(facts, side, pool_tokens, context_tokens, page_size, reported),
        max_input_tokens=side.max_input_tokens if side and pool_tokens is None else None,
        max_tokens_policy=max_tokens_policy(facts.engine),
    )


def _source(
    facts: EngineFacts,
    side: SideFacts | None,
    pool_flag: int | None,
    context_flag: int | None,
    page_flag: int | None,
    page_reported: int | None,
) -> str:
    parts: list[str] = []
    if pool_flag is not None:
        parts.append("pool: flags")
    elif side is not None:
        sized = [s for s in facts.sides if s.pool_tokens is not None]
        where = f"pool: {side.source or facts.engine} {side.role} side"
        if len(sized) > 1:
            pools = ", ".join(f"{s.role} {s.pool_tokens}" for s in sized)
            where += f" (smallest pool of {len(sized)} sides: {pools})"
        parts.append(where)
    parts.append(
        "context: flags" if context_flag is not None else f"context: {facts.context_source}"
    )
    if page_flag is None and page_reported is None:
        parts.append(f"page size: default {DEFAULT_PAGE_SIZE}")
    elif page_flag is None and page_reported is not None and page_reported < DEFAULT_PAGE_SIZE:
        parts.append(f"page size: target reports {page_reported}, laced for {DEFAULT_PAGE_SIZE}")
    return "; ".join(parts)


def _figures(pool: int | None, context: int | None) -> str:
    names = [n for n, v in (("KV pool size", pool), ("context length", context)) if v is None]
    return " and ".join(names)


def _tried(facts: EngineFacts) -> str:
    if not facts.attempts:
        return "nothing was tried"
    return "tried " + "; ".join(a.describe() for a in facts.attempts)
