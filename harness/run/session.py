"""One `kvcanary run` / `soak` session: the pieces wired together, start to report.

In order: the output directory (fresh, or a soak's journal to resume); the tenants and their
credential variables (checked before anything is sent); the target, or the bundled reference
engine started on a free loopback port; the target's limits and model (flags first); the
tokenizer, canary minter and live canary index; the planner and its three plan streams; the
target client and the detectors; the journal (`run_started` first); the runner, with Ctrl-C
wired to a graceful stop; for soaks, periodic reports and journal rotation; with
`--cache-probe`, the prefix-cache probe after the workload; finally `reports.render_run` and
the verdict.

It knows which piece needs which other piece, and nothing about how any of them works.
Heavy or optional imports (the engine, pandas via reports) happen inside functions, so the
harness runs against a remote deployment without the engine installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Protocol, TypeVar

import httpx

from canaries import (
    CanaryError,
    CanaryMinter,
    CanaryOrigin,
    Owner,
    Tokenizer,
    load_tokenizer,
)
from canaries.errors import ConfigError, RunIncomplete
from harness.detectors.content import ContentDetector
from harness.detectors.protocol import ProtocolDetector
from harness.detectors.timing import TimingDetector
from harness.record.events import Event, Limits, RunStarted
from harness.record.journal import JOURNAL_NAME, JournalWriter
from harness.run.arrivals import ClosedLoop, Pacing, PoissonArrivals
from harness.run.config import RunConfig
from harness.run.options import format_duration
from harness.run.out_dir import RunIdentity, prepare_run_dir
from harness.run.progress import ProgressDisplay
from harness.run.runner import Budget, Detectors, Runner, RunOutcome, Workload, default_phases
from harness.target.client import TargetClient, make_http_client
from harness.target.limits import limits_from_facts
from harness.target.server_info import EngineFacts, read_engine_facts
from harness.target.tokenizer import ServerTokenizer, chat_overhead, remote_tokenizer
from tenants.planner import Planner, request_id
from tenants.tenant import Tenant, default_tenants
from tenants.workload import WorkloadProfile, get_profile

SOAK_CYCLE_S = 600.0
"""A soak repeats fill / probe / abort every this many seconds (shorter soaks: once)."""
MAX_RESPONSE_BYTES = 1024 * 1024
"""Per-response bound: far more than any answer a run asks for (at most tens of tokens)."""

EXIT_BY_VERDICT = {"leak": 1, "clean": 0, "inconclusive": 3}

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RunResult:
    """How a session ended: the runner's outcome and the report's verdict."""

    out_dir: Path
    outcome: RunOutcome
    verdict: str
    reasons: tuple[str, ...]
    outputs: dict[str, Path]
    render_errors: dict[str, str]

    @property
    def exit_status(self) -> int:
        """0 clean, 1 findings, 3 no verdict (DESIGN.md, "Run output contract")."""
        return EXIT_BY_VERDICT[self.verdict]


def run_session(
    config: RunConfig,
    *,
    file: IO[str] | None = None,
    live: bool | None = None,
) -> RunResult:
    """Run `config` to its end (or Ctrl-C), render the reports, return the verdict.

    `file` and `live` go to the progress display. Raises `ConfigError` for unusable
    settings and `RunIncomplete` when no run could start.
    """
    # Everything that can be checked without the target is checked before anything starts.
    tenants = default_tenants(config.tenants, config.api_key_env)
    for tenant in tenants:
        tenant.auth_headers()  # a missing credential variable is a usage error
    profile = get_profile(config.profile)
    tokenizer = None if config.tokenizer == "server" else _local_tokenizer(config.tokenizer)
    out_dir, identity = prepare_run_dir(config)
    setup = _Setup(config, out_dir, identity, tenants, profile, tokenizer)
    display = ProgressDisplay(
        num_requests=config.num_requests, duration_s=config.duration, file=file, live=live
    )
    if config.target is not None:
        outcome = asyncio.run(_run(setup, config.target, display))
    else:
        with _bundled_engine(config, display) as base_url:
            outcome = asyncio.run(_run(setup, base_url, display))
    return _render(config, out_dir, outcome, display)


@dataclass(frozen=True, slots=True)
class _Setup:
    """What was settled before the target was contacted."""

    config: RunConfig
    out_dir: Path
    identity: RunIdentity
    tenants: list[Tenant]
    profile: WorkloadProfile
    tokenizer: Tokenizer | None
    """The local tokenizer, or None for `--tokenizer server`."""


def _local_tokenizer(spec: str) -> Tokenizer:
    try:
        return load_tokenizer(spec)
    except CanaryError as exc:
        raise ConfigError(f"--tokenizer {spec}: {exc}") from None


@contextlib.contextmanager
def _bundled_engine(config: RunConfig, display: ProgressDisplay) -> Iterator[str]:
    from reference_engine.server.launch import running_engine

    fixes = f" with fixes {', '.join(config.engine_fix)}" if config.engine_fix else ""
    cache = ", prefix cache on" if config.engine_prefix_cache else ""
    display.note(f"starting the bundled reference engine ({config.engine_preset}{fixes}{cache})")
    # Separate processes: the engine's Python never competes with the harness for one GIL,
    # which keeps its TTFT honest, and KV pages cross a real socket between the sides.
    with running_engine(
        config.engine_preset,
        fixes=tuple(config.engine_fix),
        processes=True,
        prefix_cache=config.engine_prefix_cache,
    ) as engine:
        display.note(f"engine listening at {engine.base_url}")
        yield str(engine.base_url)
    display.note("engine stopped")


def _render(
    config: RunConfig, out_dir: Path, outcome: RunOutcome, display: ProgressDisplay
) -> RunResult:
    from reports.render import render_run

    result = render_run(out_dir, keep_raw_evidence=config.keep_raw_evidence)
    reasons = tuple(str(r) for r in result.summary.get("verdict_reasons", ()))
    for name, error in result.errors.items():
        display.note(f"report output {name} could not be written: {error}")
    return RunResult(
        out_dir=out_dir,
        outcome=outcome,
        verdict=str(result.verdict),
        reasons=reasons,
        outputs=dict(result.paths),
        render_errors=dict(result.errors),
    )


# -- the run itself --------------------------------------------------------------------


async def _run(setup: _Setup, base_url: str, display: ProgressDisplay) -> RunOutcome:
    config, tenants, identity = setup.config, setup.tenants, setup.identity
    pacing = _pacing(config, identity.seed)
    max_in_flight = pacing.concurrency if isinstance(pacing, ClosedLoop) else pacing.max_in_flight
    timeout = httpx.Timeout(connect=10.0, read=config.timeout, write=60.0, pool=None)
    async with make_http_client(max_concurrency=max_in_flight, timeout=timeout) as http:
        facts = await read_engine_facts(http, base_url, headers=tenants[0].auth_headers())
        if not facts.reachable:
            raise RunIncomplete(f"cannot reach the target at {base_url}: {_why(facts)}")
        limits = limits_from_facts(
            facts,
            pool_tokens=config.pool_tokens,
            context_tokens=config.context_tokens,
            page_size=config.page_size,
        )
        model = config.model or facts.model
        if model is None:
            raise ConfigError(f"{base_url}/v1/models lists no model; pass --model NAME")
        display.note(
            f"target {base_url} ({facts.engine}), model {model}: pool {limits.pool_tokens} "
            f"tokens, context {limits.context_tokens}, page {limits.page_size} "
            f"[{limits.source}]"
        )
        planner = await _planner(setup, http, base_url, model, limits, display)
        detectors = Detectors(
            ContentDetector(planner.index, redact_excerpts=not config.keep_raw_evidence),
            ProtocolDetector(limits),
            TimingDetector(),
        )
        client = TargetClient(
            http,
            base_url,
            model=model,
            max_response_bytes=MAX_RESPONSE_BYTES,
            deadline_s=config.timeout,
        )
        journal = JournalWriter(setup.out_dir / JOURNAL_NAME)

        def emit(event: Event) -> None:
            journal.write(event)
            display.handle(event)

        try:
            emit(_run_started(config, base_url, model, limits, tenants, identity, planner))
            runner = Runner(
                sender=client,
                tenants={t.name: t for t in tenants},
                workload=Workload(
                    {
                        "victim": planner.victims(),
                        "probe": planner.probes(),
                        "abort": planner.abort_plans(),
                    },
                    default_phases(setup.profile.victim_fraction),
                ),
                index=planner.index,
                detectors=detectors,
                emit=emit,
                pacing=pacing,
                budget=_budget(config),
                keep_raw_evidence=config.keep_raw_evidence,
                num_previous_requests=identity.num_previous_requests,
            )
            display.note(f"journal: {journal.path}")
            with display, _frozen_heap():
                with _interrupts(runner, display):
                    async with _soak_tasks(config, setup.out_dir, journal, display):
                        outcome = await runner.run()
                if config.cache_probe and outcome.reason in ("completed", "duration"):
                    await _cache_probe(setup, client, planner, limits, emit, display)
                return outcome
        finally:
            journal.close()


async def _cache_probe(
    setup: _Setup,
    client: TargetClient,
    planner: Planner,
    limits: Limits,
    emit: Callable[[Event], None],
    display: ProgressDisplay,
) -> None:
    """The opt-in cache probe phase, after the workload (so no later request of this run
    can quote the probe's prompts): trials designed, sent and judged; findings journaled."""
    from harness.cache_probe.probe import (
        CacheProbe,
        design_trials,
        probe_tenants,
        settings_for,
        shares_credentials,
    )

    config = setup.config
    tenants = probe_tenants(setup.tenants, salts=config.cache_probe_salts)
    if shares_credentials(tenants):
        display.note(
            "cache probe: the tenants share one credential, so a cache keyed by credential "
            "cannot tell them apart; give each tenant its own key to test that"
        )
    settings = settings_for(
        limits,
        num_trials=config.cache_probe_trials,
        api=config.api,
        chat_overhead_tokens=planner.chat_overhead_tokens,
        seed=setup.identity.seed,
    )
    design = await asyncio.to_thread(design_trials, tenants, planner.tokenizer, settings)
    display.note(
        f"cache probe: {design.num_requests} requests, {len(design.pairs)} tenant pairs, "
        f"{settings.num_trials} trials per arm, {settings.num_prefix_tokens}-token shared "
        f"prefix of {settings.num_prompt_tokens}"
    )
    probe = CacheProbe(client, design, emit=emit)
    with _interrupts(probe, display):
        result = await probe.run()
    verdict = result.verdict.replace("_", " ").upper()
    display.note(f"cache probe: {verdict}: {'; '.join(result.assessment.reasons)}")


def _why(facts: EngineFacts) -> str:
    errors = [a.error for a in facts.attempts if a.error]
    return errors[0] if errors else "no response"


def _pacing(config: RunConfig, seed: int) -> Pacing:
    if config.rate is not None:
        return PoissonArrivals(rate=config.rate, seed=seed)
    assert config.num_workers is not None
    return ClosedLoop(config.num_workers)


def _budget(config: RunConfig) -> Budget:
    if config.duration is None:
        return Budget(num_requests=config.num_requests)
    cycle_s = SOAK_CYCLE_S if config.command == "soak" else None
    return Budget(duration_s=config.duration, cycle_s=cycle_s)


async def _planner(
    setup: _Setup,
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    limits: Limits,
    display: ProgressDisplay,
) -> Planner:
    config, tenants, identity = setup.config, setup.tenants, setup.identity
    tokenizer, remote = setup.tokenizer, None
    if tokenizer is None:
        remote = await remote_tokenizer(http, base_url, model, tenants[0])
        tokenizer = ServerTokenizer(remote, asyncio.get_running_loop(), base_url)
        display.note(
            "tokenizer: the target's own; the first plan waits for a few thousand tokenize "
            "requests that measure the canary pieces once"
        )
    num_chat_tokens = 0
    if config.api == "chat":
        num_chat_tokens = await chat_overhead(http, base_url, model, tokenizer, remote, tenants[0])
    # A given seed makes the whole run reproducible, canary key included; without one the
    # key is random and never leaves this process.
    if config.seed is not None:
        minter = CanaryMinter.from_seed(identity.seed, identity.run_id)
    else:
        minter = CanaryMinter.random()
    planner = await asyncio.to_thread(  # may count tokens, which a server tokenizer needs
        Planner,
        tenants,
        setup.profile,
        tokenizer,
        minter,
        limits,
        api=config.api,
        page_size=limits.page_size,
        seed=identity.seed,
        chat_overhead_tokens=num_chat_tokens,
        first_request=identity.next_request,
    )
    planner.index.owner_of = _owner_of(tenants)
    return planner


def _owner_of(tenants: list[Tenant]) -> Callable[[CanaryOrigin], Owner | None]:
    """Attribute a canary that left the live index, from its decoded origin."""

    def owner_of(origin: CanaryOrigin) -> Owner | None:
        if not 0 <= origin.tenant < len(tenants):
            return None
        return Owner(tenants[origin.tenant].name, request_id(origin.tenant, origin.request))

    return owner_of


def _run_started(
    config: RunConfig,
    base_url: str,
    model: str,
    limits: Limits,
    tenants: list[Tenant],
    identity: RunIdentity,
    planner: Planner,
) -> RunStarted:
    from importlib import metadata

    settings = config.to_record()
    settings["resumed"] = identity.resumed
    # the budget and pacing as applied, defaults included
    settings["num_requests"] = config.num_requests
    settings["num_workers"] = config.num_workers
    return RunStarted(
        run_id=identity.run_id,
        target=base_url,
        model=model,
        api=config.api,
        limits=limits,
        tenants=tuple(t.to_record() for t in tenants),
        seed=identity.seed,
        canary_key_id=planner.minter.key_id,
        settings=settings,
        versions={"kvcanary": metadata.version("kvcanary"), "httpx": httpx.__version__},
        t_wall=datetime.now(UTC).timestamp(),
    )


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keep the garbage collector from walking everything built so far during the run.

    A full collection over a large heap pauses the event loop for tens of milliseconds, and
    a pause while a response is streaming lands in its time to first token. Freezing moves
    the objects that exist now out of the collector's reach (vLLM's bench does the same).
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Stoppable(Protocol):
    """What Ctrl-C stops: the runner, or the cache probe."""

    @property
    def stopping(self) -> bool: ...

    def stop(self) -> None: ...

    def cancel(self) -> None: ...


@contextlib.contextmanager
def _interrupts(runner: _Stoppable, display: ProgressDisplay) -> Iterator[None]:
    """First Ctrl-C: stop sending, let requests in flight finish. Second: cancel them."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread; the caller handles cancellation
        return
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        if not runner.stopping:
            display.note(
                "interrupted: no new requests; finishing those in flight "
                "(Ctrl-C again to cancel them)"
            )
            runner.stop()
        else:
            display.note("cancelling requests in flight")
            runner.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    loop.add_signal_handler(signal.SIGTERM, runner.stop)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)


@contextlib.asynccontextmanager
async def _soak_tasks(
    config: RunConfig, out_dir: Path, journal: JournalWriter, display: ProgressDisplay
) -> AsyncIterator[None]:
    """For soaks: re-render the report every `report_every`, rotate every `rotate_every`."""
    if config.command != "soak":
        yield
        return

    async def report() -> None:
        from reports.render import render_run

        result = await asyncio.to_thread(
            render_run, out_dir, keep_raw_evidence=config.keep_raw_evidence
        )
        display.note(
            f"report updated ({display.status_line()}): verdict so far {result.verdict}, "
            f"{out_dir / 'report.html'}"
        )

    async def rotate() -> None:
        display.note(f"journal segment closed: {journal.rotate()}")

    tasks = [
        asyncio.create_task(_every(config.report_every, report, display)),
        asyncio.create_task(_every(config.rotate_every, rotate, display)),
    ]
    display.note(
        f"soak: report every {format_duration(config.report_every)}, new journal segment "
        f"every {format_duration(config.rotate_every)}"
    )
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _every(
    period_s: float, action: Callable[[], Awaitable[None]], display: ProgressDisplay
) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            await action()
        except Exception as exc:  # a failed periodic report must not end an 8-hour soak
            display.note(f"periodic task failed: {type(exc).__name__}: {exc}")
