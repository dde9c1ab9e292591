"""One `kvcanary run` / `soak` session: the pieces wired together, start to report.

In order: the output directory (fresh, or a soak's journal to resume); the tenants and their
credential variables (checked before anything is sent); the target, or the bundled reference
engine started on a free loopback port; the target's limits and model (flags first); the
tokenizer, canary minter and live canary index; the planner and its three plan streams; the
target client and the detectors; the journal (`run_started` first); the runner, with Ctrl-C
wired to a graceful stop; for soaks, periodic reports and journal rotation; finally
`reports.render_run` and the verdict.

It knows which piece needs which other piece, and nothing about how any of them works.
Heavy or optional imports (the engine, pandas via reports) happen inside functions, so the
harness runs against a remote deployment without the engine installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from canaries import (
    TAG,
    CanaryError,
    CanaryMinter,
    CanaryOrigin,
    Owner,
    RemoteTokenizer,
    Tokenizer,
    load_tokenizer,
)
from harness.arrivals import ClosedLoop, Pacing, PoissonArrivals
from harness.client import TargetClient, make_http_client
from harness.detectors.content import ContentDetector
from harness.detectors.protocol import ProtocolDetector
from harness.detectors.timing import TimingDetector
from harness.errors import ConfigError, RunIncomplete
from harness.events import Event, Limits, RunStarted
from harness.journal import JOURNAL_NAME, JournalWriter
from harness.limits import limits_from_facts
from harness.options import format_duration
from harness.progress import ProgressDisplay
from harness.run_config import RunConfig
from harness.run_dir import RunIdentity, prepare_run_dir
from harness.runner import Budget, Detectors, Runner, RunOutcome, Workload, default_phases
from harness.server_info import EngineFacts, read_engine_facts
from tenants.planner import CHAT_INSTRUCTION, Planner, request_id
from tenants.tenant import Tenant, default_tenants
from tenants.workload import WorkloadProfile, get_profile

SOAK_CYCLE_S = 600.0
"""A soak repeats fill / probe / abort every this many seconds (shorter soaks: once)."""
MAX_RESPONSE_BYTES = 1024 * 1024

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
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Run `config` to its end (or Ctrl-C), render the reports, return the verdict.

    `file` and `live` go to the progress display; `transport` replaces the network (tests).
    Raises `ConfigError` for unusable settings and `RunIncomplete` when no run could start.
    """
    tenants = default_tenants(config.tenants, config.api_key_env)
    for tenant in tenants:
        tenant.auth_headers()  # a missing credential variable is a usage error, before any I/O
    profile = get_profile(config.profile)
    out_dir, identity = prepare_run_dir(config)
    display = ProgressDisplay(
        num_requests=config.num_requests, duration_s=config.duration, file=file, live=live
    )
    if config.target is not None:
        outcome = asyncio.run(
            _run(config, config.target, out_dir, identity, tenants, profile, display, transport)
        )
    else:
        with _bundled_engine(config, display) as base_url:
            outcome = asyncio.run(
                _run(config, base_url, out_dir, identity, tenants, profile, display, transport)
            )
    return _render(config, out_dir, outcome, display)


@contextlib.contextmanager
def _bundled_engine(config: RunConfig, display: ProgressDisplay) -> Iterator[str]:
    from reference_engine.server.launch import running_engine

    fixes = f" with fixes {', '.join(config.engine_fix)}" if config.engine_fix else ""
    display.note(f"starting the bundled reference engine ({config.engine_preset}{fixes})")
    # Separate processes: the engine's Python never competes with the harness for one GIL,
    # which keeps its TTFT honest, and KV pages cross a real socket between the sides.
    with running_engine(
        config.engine_preset, fixes=tuple(config.engine_fix), processes=True
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


async def _run(
    config: RunConfig,
    base_url: str,
    out_dir: Path,
    identity: RunIdentity,
    tenants: list[Tenant],
    profile: WorkloadProfile,
    display: ProgressDisplay,
    transport: httpx.AsyncBaseTransport | None,
) -> RunOutcome:
    pacing = _pacing(config, identity.seed)
    max_in_flight = pacing.concurrency if isinstance(pacing, ClosedLoop) else pacing.max_in_flight
    timeout = httpx.Timeout(connect=10.0, read=config.timeout, write=60.0, pool=None)
    async with _http_client(max_in_flight, timeout, transport) as http:
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
        planner = await _planner(
            config, http, base_url, model, tenants, profile, limits, identity, display
        )
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
        journal = JournalWriter(out_dir / JOURNAL_NAME)

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
                    default_phases(profile.victim_fraction),
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
            with display, _interrupts(runner, display):
                async with _soak_tasks(config, out_dir, journal, display):
                    return await runner.run()
        finally:
            journal.close()


def _http_client(
    max_in_flight: int, timeout: httpx.Timeout, transport: httpx.AsyncBaseTransport | None
) -> httpx.AsyncClient:
    if transport is None:
        return make_http_client(max_concurrency=max_in_flight, timeout=timeout)
    return httpx.AsyncClient(transport=transport, timeout=timeout)


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
    config: RunConfig,
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    tenants: list[Tenant],
    profile: WorkloadProfile,
    limits: Limits,
    identity: RunIdentity,
    display: ProgressDisplay,
) -> Planner:
    tokenizer, remote = await _tokenizer(config, http, base_url, model, tenants[0])
    if remote is not None:
        display.note(
            "tokenizer: the target's own; the first plan waits for a few thousand tokenize "
            "requests that measure the canary pieces once"
        )
    chat_overhead = 0
    if config.api == "chat":
        chat_overhead = await _chat_overhead(http, base_url, model, tokenizer, remote, tenants[0])
    # A given seed makes the whole run reproducible, canary key included; without one the
    # key is random and never leaves this process.
    if config.seed is not None:
        minter = CanaryMinter.from_seed(identity.seed, identity.run_id)
    else:
        minter = CanaryMinter.random()
    planner = await asyncio.to_thread(  # may count tokens, which a server tokenizer needs
        Planner,
        tenants,
        profile,
        tokenizer,
        minter,
        limits,
        api=config.api,
        page_size=limits.page_size,
        seed=identity.seed,
        chat_overhead_tokens=chat_overhead,
        first_request=identity.next_request,
    )
    planner.index.owner_of = _owner_of(tenants)
    return planner


async def _tokenizer(
    config: RunConfig, http: httpx.AsyncClient, base_url: str, model: str, tenant: Tenant
) -> tuple[Tokenizer, RemoteTokenizer | None]:
    """The tokenizer prompts are measured in, and the target's own when that is the one."""
    if config.tokenizer != "server":
        try:
            return load_tokenizer(config.tokenizer), None
        except CanaryError as exc:
            raise ConfigError(f"--tokenizer {config.tokenizer}: {exc}") from None
    remote = RemoteTokenizer(http, base_url, headers=tenant.auth_headers(), model=model)
    try:
        await remote.count(" probe")  # learn the route now, so a missing one is a clear error
    except (CanaryError, httpx.HTTPError) as exc:
        raise ConfigError(
            f"--tokenizer server: {base_url} has no usable /v1/tokenize or /tokenize route "
            f"({exc}); give a tokenizer name or a tokenizer.json path"
        ) from None
    return ServerTokenizer(remote, asyncio.get_running_loop(), base_url), remote


class ServerTokenizer:
    """The target's tokenizer (`canaries.RemoteTokenizer`) behind the planner's synchronous
    `Tokenizer` interface.

    Each call blocks its thread on a coroutine run by the session's event loop, so calls
    must come from another thread: the runner builds plans in a worker thread. Counting is
    all prompt building needs; `decode` is not offered by a tokenize route.
    """

    vocab_size = 0
    """Unknown over HTTP; with `name` it only keys the per-tokenizer cost cache."""

    def __init__(
        self, remote: RemoteTokenizer, loop: asyncio.AbstractEventLoop, base_url: str
    ) -> None:
        self.name = f"server:{base_url}"
        self._remote = remote
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def encode(self, text: str) -> list[int]:
        return self._wait(self._remote.encode, text)

    def count(self, text: str) -> int:
        return self._wait(self._remote.count, text)

    def decode(self, ids: Sequence[int]) -> str:
        raise CanaryError("the target's tokenize route counts tokens; it cannot decode them")

    def _wait(self, call: Callable[[str], Coroutine[Any, Any, T]], text: str) -> T:
        assert threading.get_ident() != self._loop_thread, "would block the loop it waits on"
        try:
            return asyncio.run_coroutine_threadsafe(call(text), self._loop).result()
        except httpx.HTTPError as exc:
            raise RunIncomplete(f"the target's tokenize route failed: {exc!r}") from None
        except CanaryError as exc:
            raise RunIncomplete(f"the target's tokenize route failed: {exc}") from None


def _owner_of(tenants: list[Tenant]) -> Callable[[CanaryOrigin], Owner | None]:
    """Attribute a canary that left the live index, from its decoded origin."""

    def owner_of(origin: CanaryOrigin) -> Owner | None:
        if not 0 <= origin.tenant < len(tenants):
            return None
        return Owner(tenants[origin.tenant].name, request_id(origin.tenant, origin.request))

    return owner_of


async def _chat_overhead(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    tokenizer: Tokenizer,
    remote: RemoteTokenizer | None,
    tenant: Tenant,
) -> int:
    """Tokens the target's chat template adds around a planned message.

    vLLM's tokenize route renders the template itself. Otherwise one tiny chat request is
    sent and its `usage.prompt_tokens` compared with the message's own count; the message
    starts and ends like every planned chat prompt (a canary tag, then the planner's
    instruction), so the template's boundary tokens are the same.
    """
    if remote is not None:
        with contextlib.suppress(CanaryError, httpx.HTTPError):
            return await remote.chat_overhead(model)
    message = f" {TAG}{CHAT_INSTRUCTION}"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": 1,
        "stream": False,
    }
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    try:
        response = await http.post(url, json=body, headers=tenant.auth_headers())
        prompt_tokens = int(response.json()["usage"]["prompt_tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"cannot measure the chat template's size at {url} ({type(exc).__name__}: no "
            "usage in its answer); use --api completions"
        ) from None
    overhead = prompt_tokens - await asyncio.to_thread(tokenizer.count, message)
    if overhead < 0:
        raise ConfigError(
            f"{url} counts fewer tokens than --tokenizer {tokenizer.name} does; "
            "give the model's tokenizer (--tokenizer PATH/tokenizer.json)"
        )
    return overhead


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
def _interrupts(runner: Runner, display: ProgressDisplay) -> Iterator[None]:
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
