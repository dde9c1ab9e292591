"""One `kvcanary run` / `soak` session: the pieces wired together, start to report.

In order: the output directory (fresh, or a soak's journal to resume); the tenants and their
credential variables (checked before anything is sent); the target, or the bundled reference
engine started on a free loopback port; the target's limits and model (flags first); the
tokenizer, canary minter and live canary index; the planner and its three plan streams; the
target client and the detectors; the journal (`run_started` first); the runner, with Ctrl-C
wired to a graceful stop; for soaks, periodic reports and journal rotation; with
`--cache-probe`, the prefix-cache probe after the workload; finally `reports.render_run` and
the verdict.

It knows which piece needs which other piece, and nothing about how any of them works; the
pieces a reproduction shares are built in `harness.run.wiring`, Ctrl-C handling is in
`harness.run.interrupts` and a soak's periodic work in `harness.run.soak_tasks`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from kvcanary.canaries import Tokenizer
from kvcanary.canaries.errors import RunIncomplete
from kvcanary.canaries.guarantee import PageGuarantee
from kvcanary.harness.record.events import Limits
from kvcanary.harness.record.journal import JOURNAL_NAME
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.run import cost_guard, wiring
from kvcanary.harness.run.arrivals import ClosedLoop, Pacing, PoissonArrivals
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.interrupts import interrupts, sigterm_as_interrupt
from kvcanary.harness.run.keyring import EarlierRuns, Keyring
from kvcanary.harness.run.option_values import format_duration
from kvcanary.harness.run.out_dir import RunIdentity, prepare_run_dir
from kvcanary.harness.run.probe_phase import run_probe_phase
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.runner import (
    Budget,
    Detectors,
    Phase,
    Runner,
    RunOutcome,
    Sender,
    Workload,
    default_phases,
)
from kvcanary.harness.run.soak_tasks import soak_tasks
from kvcanary.harness.target.calibration import PromptTokenOffset, planning_limits
from kvcanary.harness.target.client import TargetClient
from kvcanary.harness.target.health_route import HealthProbe, health_probe
from kvcanary.harness.target.tokenizer import ServerTokenizer, chat_overhead, remote_tokenizer
from kvcanary.tenants.cost import SpendMeter
from kvcanary.tenants.planner import Planner
from kvcanary.tenants.tenant import Tenant, default_tenants
from kvcanary.tenants.workload import WorkloadProfile, get_profile

SOAK_CYCLE_S = 600.0
"""A soak repeats fill / probe / abort every this many seconds (shorter soaks: once)."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """How a session ended: the runner's outcome and the report's verdict."""

    out_dir: Path
    outcome: RunOutcome
    verdict: Verdict
    reasons: tuple[str, ...]
    outputs: dict[str, Path]
    render_errors: dict[str, str]

    @property
    def exit_status(self) -> int:
        """0 clean, 1 findings, 3 no verdict (DESIGN.md, "Run output contract"); a clean
        verdict whose reports could not all be written is 3, never 0 with reports missing."""
        if self.render_errors and self.verdict is Verdict.CLEAN:
            return Verdict.INCONCLUSIVE.exit_status
        return self.verdict.exit_status


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
    wiring.check_credentials(tenants)
    profile = get_profile(config.profile)
    tokenizer = None
    if config.tokenizer != "server":
        tokenizer = wiring.local_tokenizer(config.tokenizer, "--tokenizer")
        if config.page_size is not None:  # before anything starts, where it can be known
            wiring.lacing(tokenizer, config.page_size, strict=config.strict_page_size)
    if config.ray is not None:
        from kvcanary.harness.run.ray_sender import check_address

        check_address(config.ray)
    keyring = Keyring.open(config.keyring) if config.keyring is not None else None
    out_dir, identity = prepare_run_dir(config)
    setup = _Setup(config, out_dir, identity, tenants, profile, tokenizer, keyring)
    display = ProgressDisplay(
        num_requests=config.num_requests, duration_s=config.duration, file=file, live=live
    )
    with sigterm_as_interrupt():
        try:
            outcome = _run_on_target(setup, display)
            rendered = wiring.render(
                out_dir, keep_raw_evidence=config.keep_raw_evidence, display=display
            )
        except KeyboardInterrupt:
            if not (out_dir / JOURNAL_NAME).exists():
                raise
            raise RunIncomplete(
                f"interrupted; the journal is complete: reports not rendered; run "
                f"`kvcanary report {out_dir}`"
            ) from None
    return RunResult(
        out_dir=out_dir,
        outcome=outcome,
        verdict=Verdict(str(rendered.verdict)),
        reasons=tuple(str(r) for r in rendered.summary.get("verdict_reasons", ())),
        outputs=dict(rendered.paths),
        render_errors=dict(rendered.errors),
    )


def _run_on_target(setup: _Setup, display: ProgressDisplay) -> RunOutcome:
    config = setup.config
    if config.target is not None:
        return asyncio.run(_run(setup, config.target, display))
    engine = wiring.bundled_engine(
        config.engine_preset,
        fixes=config.engine_fix,
        overrides={"prefix_cache": True} if config.engine_prefix_cache else None,
        display=display,
    )
    with engine as base_url:
        return asyncio.run(_run(setup, base_url, display))


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
    keyring: Keyring | None = None
    """`--keyring`: where this run's key goes and earlier runs' keys come from."""


# -- the run itself --------------------------------------------------------------------


async def _run(setup: _Setup, base_url: str, display: ProgressDisplay) -> RunOutcome:
    config, tenants, identity = setup.config, setup.tenants, setup.identity
    pacing = _pacing(config, identity.seed)
    max_in_flight = pacing.concurrency if isinstance(pacing, ClosedLoop) else pacing.max_in_flight
    async with wiring.http_client(
        max_in_flight, config.timeout, backend=config.http_backend
    ) as http:
        target = await wiring.contact(
            http,
            base_url,
            tenants[0],
            pool_tokens=config.pool_tokens,
            context_tokens=config.context_tokens,
            page_size=config.page_size,
            model=config.model,
            how_to_name_model="pass --model NAME",
            display=display,
        )
        # before the first request that can cost anything (with --model and the limits
        # given, before any request at all): the calibration and tokenizer come after
        meter = cost_guard.guard(
            config, setup.profile, target.limits, _phases(setup.profile), display.note
        )
        planner, calibration, guarantee = await _planner(setup, http, target, display)
        detectors = wiring.detectors(
            planner.index,
            target.limits,
            keep_raw_evidence=config.keep_raw_evidence,
            calibration=calibration,
            earlier_runs=_earlier_runs(setup, planner, display),
        )
        client = wiring.target_client(http, target, config.timeout)
        # polled during the run where the target has one (only its status is read)
        health = await health_probe(http, target.base_url, tenants[0].auth_headers())
        journal = wiring.Journal(setup.out_dir, display)
        try:
            journal.emit(
                wiring.run_started(
                    target,
                    run_id=identity.run_id,
                    api=config.api,
                    tenants=tenants,
                    seed=identity.seed,
                    minter=planner.minter,
                    settings=_settings(config, identity, calibration),
                    guarantee=guarantee,
                )
            )
            sender = contextlib.ExitStack()
            runner = _runner(
                setup,
                sender.enter_context(_sender(setup, client, target, max_in_flight, display)),
                planner,
                detectors,
                journal,
                pacing,
                meter,
                health,
            )
            display.note(f"journal: {journal.path}")
            if identity.resumed:
                display.note(
                    f"resuming run {identity.run_id}: {identity.num_previous_requests} "
                    f"request(s) and {format_duration(identity.elapsed_s)} already done"
                )
            with sender, display, wiring.frozen_heap():
                with interrupts(runner, display):
                    async with soak_tasks(config, setup.out_dir, journal, display):
                        outcome = await runner.run()
                if config.cache_probe and outcome.reason in ("completed", "duration"):
                    await _cache_probe(setup, client, planner, target.limits, journal, display)
                return outcome
        finally:
            journal.close()


def _sender(
    setup: _Setup,
    client: TargetClient,
    target: wiring.Contact,
    max_in_flight: int,
    display: ProgressDisplay,
) -> contextlib.AbstractContextManager[Sender]:
    """This process's client, or with `--ray` one Ray actor per tenant."""
    config = setup.config
    if config.ray is None:
        return contextlib.nullcontext(client)
    from kvcanary.harness.run.ray_sender import ClientSpec, ray_sender

    spec = ClientSpec(
        target.base_url,
        target.model,
        deadline_s=config.timeout,
        read_timeout_s=config.timeout,
        max_in_flight=max_in_flight,
        backend=config.http_backend,
    )
    display.note(f"sending from {len(setup.tenants)} Ray actors (--ray {config.ray})")
    return ray_sender(config.ray, setup.tenants, spec)


def _runner(
    setup: _Setup,
    client: Sender,
    planner: Planner,
    detectors: Detectors,
    journal: wiring.Journal,
    pacing: Pacing,
    meter: SpendMeter | None = None,
    health: HealthProbe | None = None,
) -> Runner:
    """The runner over the planner's three plan streams, in the default phases."""
    config, identity = setup.config, setup.identity
    return Runner(
        sender=client,
        tenants={t.name: t for t in setup.tenants},
        workload=Workload(
            {
                "victim": planner.victims(),
                "probe": planner.probes(),
                "abort": planner.abort_plans(),
            },
            _phases(setup.profile),
        ),
        index=planner.index,
        detectors=detectors,
        emit=journal.emit,
        pacing=pacing,
        budget=_budget(config),
        keep_raw_evidence=config.keep_raw_evidence,
        num_previous_requests=identity.num_previous_requests,
        elapsed_before_s=identity.elapsed_s,
        admit=meter.admit if meter is not None else None,
        health_probe=health,
    )


def _earlier_runs(setup: _Setup, planner: Planner, display: ProgressDisplay) -> EarlierRuns | None:
    if setup.keyring is None:
        return None
    earlier = setup.keyring.earlier_runs(planner.minter.key_id)
    display.note(
        f"keyring {setup.keyring.path}: this run's key {planner.minter.key_id} kept; "
        f"{len(earlier)} earlier run(s) can be named"
    )
    return earlier


def _phases(profile: WorkloadProfile) -> tuple[Phase, ...]:
    return default_phases(profile.victim_fraction)


async def _cache_probe(
    setup: _Setup,
    client: TargetClient,
    planner: Planner,
    limits: Limits,
    journal: wiring.Journal,
    display: ProgressDisplay,
) -> None:
    """The opt-in cache probe phase, after the workload (so no later request of this run
    can quote the probe's prompts)."""
    from kvcanary.harness.cache_probe.probe import settings_for, shares_credentials

    config = setup.config
    if shares_credentials(setup.tenants):
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
    await run_probe_phase(
        client,
        setup.tenants,
        planner.tokenizer,
        settings,
        salts=config.cache_probe_salts,
        emit=journal.emit,
        display=display,
        wrap=lambda probe: interrupts(probe, display),
    )


def _settings(
    config: RunConfig, identity: RunIdentity, calibration: PromptTokenOffset | None
) -> dict[str, Any]:
    settings = config.to_record()
    settings["prompt_token_offset"] = calibration.to_dict() if calibration is not None else None
    settings["resumed"] = identity.resumed
    settings["elapsed_before_s"] = identity.elapsed_s
    # the budget and pacing as applied, defaults included
    settings["num_requests"] = config.num_requests
    settings["num_workers"] = config.num_workers
    return settings


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
    setup: _Setup, http: httpx.AsyncClient, target: wiring.Contact, display: ProgressDisplay
) -> tuple[Planner, PromptTokenOffset | None, PageGuarantee]:
    config, tenants, identity = setup.config, setup.tenants, setup.identity
    base_url, model = target.base_url, target.model
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
    calibration = await wiring.calibrate(
        http,
        target,
        config.api,
        tokenizer,
        tenants[0],
        chat_overhead_tokens=num_chat_tokens,
        display=display,
    )
    limits = planning_limits(target.limits, calibration)
    alphabet, guarantee = await asyncio.to_thread(  # counts tokens, as the planner may
        wiring.lacing, tokenizer, limits.page_size, strict=config.strict_page_size
    )
    if not guarantee.per_page:
        display.note(f"canaries: {guarantee.sentence()}")
    minter = wiring.canary_minter(
        identity.seed,
        identity.run_id,
        seeded=config.seed is not None,
        keyring=setup.keyring,
        tenants=tenants,
        alphabet=alphabet,
    )
    planner = await asyncio.to_thread(  # may count tokens, which a server tokenizer needs
        Planner,
        tenants,
        setup.profile,
        tokenizer,
        minter,
        limits,
        api=config.api,
        page_size=guarantee.window,
        seed=identity.seed,
        chat_overhead_tokens=num_chat_tokens,
        first_request=identity.next_request,
    )
    planner.index.owner_of = wiring.owner_of(tenants)
    return planner, calibration, guarantee
