"""One `kvcanary run` / `soak` session: the settings checked, the run composed, the report.

In order: the tenants and their credential variables, the tokenizer and page size, the
output directory (fresh, or a soak's journal to resume), and with `--ray` the connection to
the Ray cluster: all checked before anything is written or sent. Then the run composed by
`harness.run.assembly` (the target or the bundled engine, first contact, the cost guard,
the planner, detectors and journal), and on it what a session adds: the runner over the
fill / probe / abort phases, sending from this process or from Ray actors, with Ctrl-C wired
to a graceful stop; for soaks, periodic reports and journal rotation; with `--cache-probe`,
the prefix-cache probe after the workload and before `run_finished` (so the run's duration
and verdict include it); finally `reports.render_run` and the verdict.

It knows which piece needs which other piece, and nothing about how any of them works;
Ctrl-C handling is in `harness.run.interrupts` and a soak's periodic work in
`harness.run.soak_tasks`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvcanary.canaries.errors import RunIncomplete
from kvcanary.harness.record.events import Limits
from kvcanary.harness.record.journal import JOURNAL_NAME
from kvcanary.harness.record.verdict import Verdict, exit_status
from kvcanary.harness.run import cost_guard, rendering, wiring
from kvcanary.harness.run.arrivals import ClosedLoop, Pacing, PoissonArrivals
from kvcanary.harness.run.assembly import Assembly, Blueprint, Declared, assembled, on_target
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.interrupts import interrupts, sigterm_as_interrupt
from kvcanary.harness.run.keyring import Keyring
from kvcanary.harness.run.option_values import format_duration
from kvcanary.harness.run.out_dir import RunIdentity, prepare_run_dir
from kvcanary.harness.run.phases import Budget, Phase, Workload, default_phases
from kvcanary.harness.run.probe_phase import run_probe_phase
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.runner import Runner, RunOutcome, Sender
from kvcanary.harness.run.seams import RemoteSender
from kvcanary.harness.run.soak_tasks import set_aside_stale_reports, soak_tasks
from kvcanary.harness.target.calibration import PromptTokenOffset
from kvcanary.harness.target.health_route import HealthProbe, health_probe
from kvcanary.harness.target.tokenizer import AUTO, local_tokenizer_name
from kvcanary.tenants.cost import SpendMeter
from kvcanary.tenants.tenant import default_tenants
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
        """The verdict's exit status (0 clean, 1 findings, 3 no verdict); a clean verdict
        whose reports could not all be written is 3, never 0 with reports missing."""
        return exit_status(self.verdict, reports_complete=not self.render_errors)


@dataclass(frozen=True, slots=True)
class _Setup:
    """What was settled before the target was contacted."""

    config: RunConfig
    blueprint: Blueprint
    pacing: Pacing


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
    setup = _settle(config)
    out_dir = setup.blueprint.out_dir
    display = ProgressDisplay(
        num_requests=config.num_requests, duration_s=config.duration, file=file, live=live
    )
    engine = None
    if config.target is None:
        engine = wiring.bundled_engine(
            config.engine_preset,
            fixes=config.engine_fix,
            overrides={"prefix_cache": True} if config.engine_prefix_cache else None,
            display=display,
        )
    with (
        sigterm_as_interrupt(),
        _ray_cluster(config),
        _stale_unless_rendered(config, out_dir, display),
    ):
        try:
            outcome = on_target(config.target, engine, functools.partial(_run, setup, display))
            rendered = rendering.render(
                out_dir,
                keep_raw_evidence=config.keep_raw_evidence,
                display=display,
                apart=True if config.command == "soak" else None,  # flat memory, render included
            )
        except KeyboardInterrupt:
            if not (out_dir / JOURNAL_NAME).exists():
                raise
            raise RunIncomplete(
                f"interrupted; the journal is complete: reports not rendered; run "
                f"`kvcanary report {out_dir}`"
            ) from None
        if config.command == "soak" and rendered.errors:
            set_aside_stale_reports(out_dir, display, rendered.errors.keys())
    return RunResult(
        out_dir=out_dir,
        outcome=outcome,
        verdict=Verdict(str(rendered.verdict)),
        reasons=tuple(str(r) for r in rendered.summary.get("verdict_reasons", ())),
        outputs=dict(rendered.paths),
        render_errors=dict(rendered.errors),
    )


def _settle(config: RunConfig) -> _Setup:
    """Everything that can be checked without the target, checked before anything starts."""
    tenants = default_tenants(config.tenants, config.api_key_env)
    wiring.check_credentials(tenants)
    profile = get_profile(config.profile)
    tokenizer = None
    local_name = local_tokenizer_name(config.tokenizer)
    if local_name is not None:
        tokenizer = wiring.local_tokenizer(local_name, "--tokenizer")
        # before anything starts, where it can be known (`auto` counts with a target's own)
        known = config.tokenizer != AUTO or config.target is None
        if config.page_size is not None and known:
            wiring.lacing(tokenizer, config.page_size, strict=config.strict_page_size)
    keyring = Keyring.open(config.keyring) if config.keyring is not None else None
    out_dir, identity = prepare_run_dir(config)
    pacing = _pacing(config, identity.seed)
    in_flight = pacing.concurrency if isinstance(pacing, ClosedLoop) else pacing.max_in_flight
    blueprint = Blueprint(
        out_dir=out_dir,
        tenants=tenants,
        profile=profile,
        identity=identity,
        seeded=config.seed is not None,
        api=config.api,
        tokenizer=tokenizer,
        auto_tokenizer=config.tokenizer == AUTO,
        declared=Declared(
            config.pool_tokens, config.context_tokens, config.page_size, config.model
        ),
        timeout_s=config.timeout,
        max_in_flight=in_flight,
        keep_raw_evidence=config.keep_raw_evidence,
        strict_page_size=config.strict_page_size,
        keyring=keyring,
        backend=config.http_backend,
    )
    return _Setup(config, blueprint, pacing)


@contextlib.contextmanager
def _stale_unless_rendered(
    config: RunConfig, out_dir: Path, display: ProgressDisplay
) -> Iterator[None]:
    """A soak that ends without its final render sets its periodic reports aside."""
    try:
        yield
    except BaseException:
        if config.command == "soak":
            set_aside_stale_reports(out_dir, display)
        raise


def _ray_cluster(config: RunConfig) -> contextlib.AbstractContextManager[None]:
    """With `--ray`, connected to the cluster before anything is written or sent."""
    if config.ray is None:
        return contextlib.nullcontext()
    from kvcanary.harness.run.ray_cluster import ray_cluster

    return ray_cluster(config.ray)


# -- the run itself --------------------------------------------------------------------


async def _run(setup: _Setup, display: ProgressDisplay, base_url: str) -> RunOutcome:
    config, bp = setup.config, setup.blueprint
    settings = functools.partial(_settings, config, bp.identity)
    vet = functools.partial(_guard, config, bp.profile, display)
    async with assembled(bp, base_url, display, settings=settings, vet=vet) as run:
        # polled during the run where the target has one (only its status is read)
        health = await health_probe(
            run.http,
            run.target.base_url,
            bp.tenants[0].auth_headers(),
            timeout_s=config.health_timeout,
        )
        identity = bp.identity
        if identity.resumed:
            display.note(
                f"resuming run {identity.run_id}: {identity.num_previous_requests} "
                f"request(s) and {format_duration(identity.elapsed_s)} already done"
            )
        with _sender(setup, run, display) as sender, display, wiring.frozen_heap():
            runner = _runner(setup, run, sender, health)
            with interrupts(runner, display):
                async with soak_tasks(config, bp.out_dir, run.journal, display):
                    outcome = await runner.run()
            if config.cache_probe and outcome.reason in ("completed", "duration"):
                num_probed, stopped = await _cache_probe(setup, run, display)
                if stopped:
                    outcome.reason = "interrupted"
                run.journal.finish(num_more_requests=num_probed, reason=outcome.reason)
            return outcome


def _sender(
    setup: _Setup, run: Assembly, display: ProgressDisplay
) -> contextlib.AbstractContextManager[Sender | RemoteSender]:
    """This process's client, or with `--ray` one Ray actor per tenant."""
    config = setup.config
    if config.ray is None:
        return contextlib.nullcontext(run.client)
    from kvcanary.harness.run.ray_kit import ClientSpec
    from kvcanary.harness.run.ray_sender import ray_sender

    spec = ClientSpec(
        run.target.base_url,
        run.target.model,
        deadline_s=config.timeout,
        read_timeout_s=config.timeout,
        max_in_flight=setup.blueprint.max_in_flight,
        backend=config.http_backend,
    )
    display.note(f"sending from {len(setup.blueprint.tenants)} Ray actors (--ray {config.ray})")
    return ray_sender(run, spec)


def _runner(
    setup: _Setup, run: Assembly, sender: Sender | RemoteSender, health: HealthProbe | None
) -> Runner:
    """The runner over the planner's three plan streams, in the default phases."""
    config, bp = setup.config, setup.blueprint
    planner = run.planner
    return Runner(
        sender=sender,
        tenants={t.name: t for t in bp.tenants},
        workload=Workload(
            {
                "victim": planner.victims(),
                "probe": planner.probes(),
                "abort": planner.abort_plans(),
            },
            _phases(bp.profile),
        ),
        index=planner.index,
        detectors=run.detectors,
        emit=run.journal.emit,
        pacing=setup.pacing,
        budget=_budget(config),
        keep_raw_evidence=config.keep_raw_evidence,
        num_previous_requests=bp.identity.num_previous_requests,
        elapsed_before_s=bp.identity.elapsed_s,
        admit=run.meter.admit if run.meter is not None else None,
        health_probe=health,
        emit_line=run.journal.emit,
    )


def _guard(
    config: RunConfig, profile: WorkloadProfile, display: ProgressDisplay, limits: Limits
) -> SpendMeter | None:
    """The cost guard, before the first request that can cost anything (with --model and
    the limits given, before any request at all)."""
    return cost_guard.guard(config, profile, limits, _phases(profile), display.note)


def _phases(profile: WorkloadProfile) -> tuple[Phase, ...]:
    return default_phases(profile.victim_fraction)


async def _cache_probe(setup: _Setup, run: Assembly, display: ProgressDisplay) -> tuple[int, bool]:
    """The opt-in cache probe phase, after the workload (so no later request of this run
    can quote the probe's prompts); how many requests it sent, and whether it was stopped."""
    from kvcanary.harness.cache_probe.probe import settings_for

    config = setup.config
    settings = settings_for(
        run.target.limits,
        num_trials=config.cache_probe_trials,
        api=config.api,
        chat_overhead_tokens=run.planner.chat_overhead_tokens,
        seed=setup.blueprint.identity.seed,
    )
    result, num_requests = await run_probe_phase(
        run.client,
        setup.blueprint.tenants,
        run.planner.tokenizer,
        settings,
        salts=config.cache_probe_salts,
        emit=run.journal.emit,
        display=display,
        counters=run.cache_counters(),
        wrap=lambda probe: interrupts(probe, display),
    )
    return num_requests, result.stopped


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
