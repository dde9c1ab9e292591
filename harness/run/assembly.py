"""The one composition of a run, which `run`, `soak`, `repro` and the pytest plugin (through
`run_session`) all go through; the pieces themselves are built in `harness.run.wiring`.

    Blueprint    what an entry point settles before the target is contacted: the output
                 directory, the tenants, the run's identity, the tokenizer, what the user
                 declared about the target
    on_target    the target URL, or the bundled engine for the run's duration; the run's
                 coroutine in a fresh event loop whose Ctrl-C / SIGTERM cancel it where it
                 awaits (never a KeyboardInterrupt inside whichever task happens to run)
    assembled    the HTTP client; first contact (facts, limits, model); the entry point's
                 check before anything can cost (the cost guard, a scenario's sizes); the
                 tokenizer, calibration, canary alphabet, minter and planner; the detectors
                 and target client; the journal with `run_started` first and `run_finished`
                 held until the entry point's work is done (`harness.run.run_journal`)

What differs stays with each entry point: a session's runner, phases and cache probe
(`harness.run.session`); a scenario's ordered steps and judgement (`harness.scenarios.repro`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvcanary.canaries import Tokenizer
from kvcanary.canaries.guarantee import PageGuarantee
from kvcanary.harness.cache_probe.counters import MetricsCounters
from kvcanary.harness.record.events import Limits
from kvcanary.harness.run import wiring
from kvcanary.harness.run.interrupts import Interrupted, cancel_on_signal
from kvcanary.harness.run.keyring import EarlierRuns, Keyring, run_key
from kvcanary.harness.run.out_dir import RunIdentity
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.run_journal import Journal
from kvcanary.harness.run.seams import Detectors, TimingChecker
from kvcanary.harness.target.calibration import PromptTokenOffset, planning_limits
from kvcanary.harness.target.client import TargetClient
from kvcanary.harness.target.http_client import DEFAULT_BACKEND, Backend
from kvcanary.harness.target.tokenizer import chat_overhead, choose_tokenizer
from kvcanary.tenants.cost import SpendMeter
from kvcanary.tenants.plan import ApiStyle
from kvcanary.tenants.planner import Planner
from kvcanary.tenants.tenant import Tenant
from kvcanary.tenants.workload import WorkloadProfile

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Declared:
    """What the user declared about the target (flags, a scenario): above what it says."""

    pool_tokens: int | None = None
    context_tokens: int | None = None
    page_size: int | None = None
    model: str | None = None
    how_to_name_model: str = "pass --model NAME"
    """The end of the error when the model is neither declared nor listed by the target."""


@dataclass(frozen=True, slots=True)
class Blueprint:
    """What an entry point settled before the target was contacted."""

    out_dir: Path
    tenants: Sequence[Tenant]
    profile: WorkloadProfile
    identity: RunIdentity
    seeded: bool
    """A seed was given: the canary key derives from it (the run is reproducible)."""
    api: ApiStyle
    tokenizer: Tokenizer | None
    """The local tokenizer, or None to count with the target's own."""
    declared: Declared
    timeout_s: float
    max_in_flight: int
    keep_raw_evidence: bool = False
    strict_page_size: bool = False
    lace_every_page: bool = False
    """Lace every page or fail when a prompt is built (a scenario: its page size is part of
    its recipe); by default a page too small for a canary is laced for the window the page
    size guarantees, and the run says so (`canaries.guarantee`)."""
    auto_tokenizer: bool = False
    """`--tokenizer auto`: the target's own where it serves a tokenize route, else
    `tokenizer` (`harness.target.tokenizer.choose_tokenizer`)."""
    keyring: Keyring | None = None
    backend: Backend = DEFAULT_BACKEND
    transport: httpx.AsyncBaseTransport | None = None
    """Replaces the network (tests)."""


@dataclass(frozen=True, slots=True)
class Assembly:
    """The run, wired: what a session's runner and a scenario's steps send through."""

    blueprint: Blueprint
    http: httpx.AsyncClient
    target: wiring.Contact
    planner: Planner
    calibration: PromptTokenOffset | None
    guarantee: PageGuarantee
    client: TargetClient
    detectors: Detectors
    journal: Journal
    meter: SpendMeter | None = None
    """The cost guard's meter, where the entry point's check returned one."""
    key: bytes = field(default=b"", repr=False)
    """The run's canary key: the planner's minter's (`--ray` hands it to the actors)."""

    def cache_counters(self) -> MetricsCounters:
        """The target's prefix-cache counters, read as the first tenant (the cache probe)."""
        headers = self.blueprint.tenants[0].auth_headers()
        return MetricsCounters(self.http, self.target.base_url, headers)


def on_target(
    url: str | None,
    engine: contextlib.AbstractContextManager[str] | None,
    main: Callable[[str], Coroutine[Any, Any, T]],
) -> T:
    """`main(base_url)` against `url`, else against the bundled `engine` while it runs.

    Ctrl-C or SIGTERM cancels `main` where it awaits (its cleanup runs) and comes out of
    here as a `KeyboardInterrupt`.
    """
    if url is not None:
        return _run(main(url))
    assert engine is not None, "no target and no engine"
    with engine as base_url:
        return _run(main(base_url))


def _run(main: Coroutine[Any, Any, T]) -> T:
    async def guarded() -> T:
        with cancel_on_signal():
            return await main

    try:
        return asyncio.run(guarded())
    except Interrupted:
        raise KeyboardInterrupt from None


@contextlib.asynccontextmanager
async def assembled(
    blueprint: Blueprint,
    base_url: str,
    display: ProgressDisplay,
    *,
    settings: Callable[[PromptTokenOffset | None], dict[str, Any]],
    vet: Callable[[Limits], SpendMeter | None] | None = None,
    timing: TimingChecker | None = None,
) -> AsyncIterator[Assembly]:
    """The run wired against `base_url` and journaled; see the module docstring.

    `settings(calibration)` is `run_started`'s settings record; `vet(limits)` runs before
    the first request that can cost anything (it raises to refuse, and may return the cost
    meter); `timing` replaces the timing detector. Raises `RunIncomplete` when the target
    cannot be reached and `ConfigError` for what the user must change.
    """
    bp = blueprint
    async with wiring.http_client(
        bp.max_in_flight, bp.timeout_s, bp.transport, backend=bp.backend
    ) as http:
        target = await _contact(bp, http, base_url, display)
        meter = vet(target.limits) if vet is not None else None
        planner, calibration, guarantee, key = await _planner(bp, http, target, display)
        detectors = wiring.detectors(
            planner.index,
            target.limits,
            keep_raw_evidence=bp.keep_raw_evidence,
            timing=timing,
            calibration=calibration,
            earlier_runs=_earlier_runs(bp, planner, display),
        )
        client = wiring.target_client(http, target.base_url, target.model, bp.timeout_s)
        journal = Journal(bp.out_dir, display)
        try:
            journal.emit(
                wiring.run_started(
                    target,
                    run_id=bp.identity.run_id,
                    api=bp.api,
                    tenants=bp.tenants,
                    seed=bp.identity.seed,
                    minter=planner.minter,
                    settings=settings(calibration),
                    guarantee=guarantee,
                )
            )
            display.note(f"journal: {journal.path}")
            yield Assembly(
                bp, http, target, planner, calibration, guarantee, client, detectors, journal,
                meter, key,
            )  # fmt: skip
        finally:
            journal.close()


async def _contact(
    bp: Blueprint, http: httpx.AsyncClient, base_url: str, display: ProgressDisplay
) -> wiring.Contact:
    declared = bp.declared
    return await wiring.contact(
        http,
        base_url,
        bp.tenants[0],
        pool_tokens=declared.pool_tokens,
        context_tokens=declared.context_tokens,
        page_size=declared.page_size,
        model=declared.model,
        how_to_name_model=declared.how_to_name_model,
        display=display,
    )


async def _planner(
    bp: Blueprint, http: httpx.AsyncClient, target: wiring.Contact, display: ProgressDisplay
) -> tuple[Planner, PromptTokenOffset | None, PageGuarantee, bytes]:
    """The tokenizer (the target's own where none was given), the calibration, the canary
    alphabet and what the page size guarantees with it, the minter, the planner; the key."""
    tenants, identity = list(bp.tenants), bp.identity
    tokenizer, remote = await choose_tokenizer(
        http, target.base_url, target.model, tenants[0],
        local=bp.tokenizer, auto=bp.auto_tokenizer, note=display.note,
    )  # fmt: skip
    num_chat_tokens = 0
    if bp.api == "chat":
        num_chat_tokens = await chat_overhead(
            http, target.base_url, target.model, tokenizer, remote, tenants[0]
        )
    calibration = await wiring.calibrate(
        http, target, bp.api, tokenizer, tenants[0],
        chat_overhead_tokens=num_chat_tokens, display=display,
    )  # fmt: skip
    limits = planning_limits(target.limits, calibration)
    alphabet, guarantee = await asyncio.to_thread(  # counts tokens, as the planner may
        wiring.lacing, tokenizer, limits.page_size, strict=bp.strict_page_size
    )
    page_size = limits.page_size if bp.lace_every_page else guarantee.window
    if not guarantee.per_page and not bp.lace_every_page:
        display.note(f"canaries: {guarantee.sentence()}")
    key = run_key(identity.seed, identity.run_id, seeded=bp.seeded)
    minter = wiring.canary_minter(
        identity.seed, identity.run_id, seeded=bp.seeded, keyring=bp.keyring,
        tenants=tenants, alphabet=alphabet, key=key,
    )  # fmt: skip
    planner = await asyncio.to_thread(  # may count tokens, which a server tokenizer needs
        Planner, tenants, bp.profile, tokenizer, minter, limits,
        api=bp.api, page_size=page_size, seed=identity.seed,
        chat_overhead_tokens=num_chat_tokens, first_request=identity.next_request,
    )  # fmt: skip
    planner.index.owner_of = wiring.owner_of(tenants)
    return planner, calibration, guarantee, key


def _earlier_runs(bp: Blueprint, planner: Planner, display: ProgressDisplay) -> EarlierRuns | None:
    if bp.keyring is None:
        return None
    earlier = bp.keyring.earlier_runs(planner.minter.key_id)
    display.note(
        f"keyring {bp.keyring.path}: this run's key {planner.minter.key_id} kept; "
        f"{len(earlier)} earlier run(s) can be named"
    )
    return earlier
