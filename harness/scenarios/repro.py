"""`kvcanary repro`: run a scenario's ordered steps, then judge what was found against it.

The run is composed by `harness.run.assembly`, as `kvcanary run`'s is: tenants and their
credential variables first; the target, or the scenario's bundled engine on a free loopback
port; the target's limits (the scenario's figures first) and model; the planner, target
client and the three detectors; the journal (`run_started` first); finally the render, so a
reproduction leaves the same evidence bundle (journal, summary, reports, `evidence/`) as a
run and can be re-rendered with `kvcanary report`. What is a scenario's own is here: its
settings, its steps (`harness.scenarios.steps`) and its verdict (`harness.scenarios.judge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import FindingRecorded, Limits, RunFinished, TimingFitted
from kvcanary.harness.record.journal import JOURNAL_NAME
from kvcanary.harness.record.verdict import Reproduction
from kvcanary.harness.run import rendering, wiring
from kvcanary.harness.run.assembly import Blueprint, Declared, assembled, on_target
from kvcanary.harness.run.interrupts import sigterm_as_interrupt
from kvcanary.harness.run.out_dir import RunIdentity, fresh_out_dir, new_run_id
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.run_journal import Journal
from kvcanary.harness.scenarios.judge import ReproResult, StepReport, judge
from kvcanary.harness.scenarios.schema import Scenario
from kvcanary.harness.scenarios.steps import DeferredFinish, Steps
from kvcanary.tenants.workload import WorkloadProfile

# -- running a scenario ----------------------------------------------------------------


def run_repro(
    scenario: Scenario,
    *,
    target: str | None = None,
    out: str | Path | None = None,
    api_key_env: str | None = None,
    keep_raw_evidence: bool = False,
    file: IO[str] | None = None,
    live: bool | None = None,
    engine_processes: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ReproResult:
    """Run `scenario` against `target` (else its own target, else its bundled engine).

    Raises `ConfigError` for unusable input (exit 2); every other ending is a verdict.
    `engine_processes=False` runs the bundled engine in this process (faster to start).
    """
    url = target or scenario.target
    if url is None and scenario.engine is None:
        raise ConfigError(f"scenario {scenario.name} runs against a deployment: pass --target URL")
    display = ProgressDisplay(num_requests=scenario.num_requests, file=file, live=live)
    repro = _Repro(
        scenario,
        _blueprint(scenario, api_key_env, out, keep_raw_evidence, transport),
        display,
        [],
    )
    display.note(f"scenario {scenario.name}: expects {scenario.expect.describe()}")
    engine = None
    if scenario.engine is not None:
        if url is not None:
            display.note(
                f"--target given: the scenario's [engine] ({scenario.engine.preset}) is not used"
            )
        engine = wiring.bundled_engine(
            scenario.engine.preset,
            fixes=scenario.engine.fixes,
            overrides=scenario.engine.overrides,
            processes=engine_processes,
            display=display,
        )
    with sigterm_as_interrupt():  # a CI job's timeout still gets the evidence rendered
        ended, why = _send(repro, url, engine)
        if ended is None:
            return ReproResult(scenario, Reproduction.INCONCLUSIVE, why, None, target=url)
        return _finish(repro, url, ended, why)


def _blueprint(
    scenario: Scenario,
    api_key_env: str | None,
    out: str | Path | None,
    keep_raw_evidence: bool,
    transport: httpx.AsyncBaseTransport | None,
) -> Blueprint:
    """What a scenario settles before the target is contacted (checked before any I/O)."""
    tenants = scenario.tenants.build(api_key_env)
    wiring.check_credentials(tenants)
    tokenizer = wiring.local_tokenizer(
        scenario.client.tokenizer, f"{scenario.source}: [client] tokenizer"
    )
    seed = scenario.seed if scenario.seed is not None else random.SystemRandom().randrange(2**32)
    spec = scenario.limits
    return Blueprint(
        out_dir=fresh_out_dir(out),
        tenants=tenants,
        profile=_profile(scenario),
        identity=RunIdentity(new_run_id(), seed, 0, 0, resumed=False),
        seeded=scenario.seed is not None,
        api="completions",
        tokenizer=tokenizer,
        declared=Declared(
            spec.pool_tokens,
            spec.context_tokens,
            spec.page_size,
            scenario.client.model,
            f"set [client] model in {scenario.source}",
        ),
        timeout_s=scenario.client.timeout_s,
        max_in_flight=max((step.concurrency for step in scenario.send_steps), default=1),
        keep_raw_evidence=keep_raw_evidence,
        lace_every_page=True,
        transport=transport,
    )


def _send(
    repro: _Repro, url: str | None, engine: contextlib.AbstractContextManager[str] | None
) -> tuple[str | None, tuple[str, ...]]:
    """Run the steps; how the run ended (None: nothing was journaled) and why."""
    journal = repro.blueprint.out_dir / JOURNAL_NAME
    try:
        return on_target(url, engine, lambda base_url: _run(repro, base_url)), ()
    except RunIncomplete as exc:
        return ("error" if journal.exists() else None), (str(exc),)
    except KeyboardInterrupt:
        if journal.exists():
            return "interrupted", ()  # the judgement says the run ended early
        return None, ("interrupted",)


def _finish(repro: _Repro, url: str | None, ended: str, why: tuple[str, ...]) -> ReproResult:
    out_dir = repro.blueprint.out_dir
    rendered = rendering.render(
        out_dir, keep_raw_evidence=repro.blueprint.keep_raw_evidence, display=repro.display
    )
    # the journal is the record: findings counted there include the timing detector's
    # end-of-run ones, which no step saw
    findings = rendered.summary["counts"]["findings"]
    verdict, reasons = judge(repro.scenario.expect, findings, repro.reports, ended)
    return ReproResult(
        scenario=repro.scenario,
        verdict=verdict,
        reasons=(*why, *reasons),
        out_dir=out_dir,
        target=url,
        findings={k: int(n) for k, n in findings.items() if n},
        steps=tuple(repro.reports),
        outputs=dict(rendered.paths),
        render_errors=dict(rendered.errors),
    )


@dataclass(frozen=True, slots=True)
class _Repro:
    """What a reproduction settled before the target was contacted."""

    scenario: Scenario
    blueprint: Blueprint
    display: ProgressDisplay
    reports: list[StepReport]
    """Fills in as steps end (also when the run is cut short)."""


async def _run(repro: _Repro, base_url: str) -> str:
    """Send every step; returns how the run ended."""
    scenario, display = repro.scenario, repro.display
    timing = TimingDetector()
    async with assembled(
        repro.blueprint,
        base_url,
        display,
        settings=lambda _: scenario.to_record(),
        vet=lambda limits: _check_sizes(scenario, limits),
        timing=DeferredFinish(timing),
    ) as run:
        steps = Steps(scenario, run, display)
        ended, message = "error", None
        try:
            with display:
                ended = await steps.run(repro.reports)
        except asyncio.CancelledError:
            ended, message = "interrupted", "the run was cancelled"
            raise
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if ended != "error":
                _finish_timing(timing, run.journal)
            run.journal.finish(RunFinished(ended, time.time(), steps.num_requests, message))
        return ended


def _finish_timing(timing: TimingDetector, journal: Journal) -> None:
    """The timing detector's end-of-run pass, once, after the last step."""
    for finding in timing.finish():
        journal.emit(FindingRecorded(finding, t_wall=time.time()))
    model = timing.model.to_dict() if timing.model is not None else None
    journal.emit(TimingFitted(model, time.time(), final=True, not_judged=timing.not_judged))


def _check_sizes(scenario: Scenario, limits: Limits) -> None:
    """Every size against the real limits, errors naming the scenario line."""
    for step in scenario.send_steps:
        for spec in step.sizes:
            try:
                spec.resolve(limits)
            except ConfigError as exc:
                key = "size" if step.kind == "disconnect" else "sizes"
                raise ConfigError(f"{scenario.where(step, key)}: {exc}") from None


def _profile(scenario: Scenario) -> WorkloadProfile:
    """The scenario's sizes as a workload profile (the planner's streams; steps pick)."""
    sizes = {kind: [s for step in scenario.send_steps if step.kind == kind for s in step.sizes]
             for kind in ("victims", "probes", "disconnect")}  # fmt: skip
    return WorkloadProfile(
        name=f"scenario:{scenario.name}",
        description=scenario.summary,
        victims=sizes["victims"],
        probes=[*sizes["probes"], *sizes["disconnect"]],
    )


__all__ = ["ReproResult", "StepReport", "judge", "run_repro"]
