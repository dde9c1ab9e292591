"""`kvcanary repro`: run a scenario's ordered steps, then judge what was found against it.

The run is put together by `harness.run.wiring`, as `kvcanary run`'s is: tenants and their
credential variables first; the target, or the scenario's bundled engine on a free loopback
port; the target's limits (the scenario's figures first) and model; the planner, target
client and the three detectors; the journal (`run_started` first); finally the render, so a
reproduction leaves the same evidence bundle (journal, summary, reports, `evidence/`) as a
run and can be re-rendered with `kvcanary report`. What is a scenario's own is here: its
settings, its steps (`harness.scenarios.steps`) and its verdict (`harness.scenarios.judge`).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from kvcanary.canaries import Tokenizer
from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import FindingRecorded, Limits, RunFinished, TimingFitted
from kvcanary.harness.record.journal import JOURNAL_NAME
from kvcanary.harness.record.verdict import Reproduction
from kvcanary.harness.run import wiring
from kvcanary.harness.run.interrupts import sigterm_as_interrupt
from kvcanary.harness.run.out_dir import fresh_out_dir, new_run_id
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.scenarios.judge import ReproResult, StepReport, judge
from kvcanary.harness.scenarios.schema import Scenario
from kvcanary.harness.scenarios.steps import DeferredFinish, Steps
from kvcanary.harness.target.calibration import PromptTokenOffset, planning_limits
from kvcanary.tenants.planner import Planner
from kvcanary.tenants.tenant import Tenant
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
    tenants = scenario.tenants.build(api_key_env)
    wiring.check_credentials(tenants)
    url = target or scenario.target
    if url is None and scenario.engine is None:
        raise ConfigError(f"scenario {scenario.name} runs against a deployment: pass --target URL")
    out_dir = fresh_out_dir(out)
    display = ProgressDisplay(num_requests=scenario.num_requests, file=file, live=live)
    display.note(f"scenario {scenario.name}: expects {scenario.expect.describe()}")
    if url is not None and scenario.engine is not None:
        display.note(
            f"--target given: the scenario's [engine] ({scenario.engine.preset}) is not used"
        )
    reports: list[StepReport] = []
    ended = "completed"
    why: tuple[str, ...] = ()
    repro = _Repro(scenario, out_dir, tenants, display, keep_raw_evidence, transport, reports)
    with sigterm_as_interrupt():  # a CI job's timeout still gets the evidence rendered
        try:
            if url is not None:
                ended = asyncio.run(_run(repro, url))
            else:
                assert scenario.engine is not None
                engine = wiring.bundled_engine(
                    scenario.engine.preset,
                    fixes=scenario.engine.fixes,
                    overrides=scenario.engine.overrides,
                    processes=engine_processes,
                    display=display,
                )
                with engine as url:
                    ended = asyncio.run(_run(repro, url))
        except RunIncomplete as exc:
            if not (out_dir / JOURNAL_NAME).exists():
                return ReproResult(
                    scenario, Reproduction.INCONCLUSIVE, (str(exc),), None, target=url
                )
            ended, why = "error", (str(exc),)
        except KeyboardInterrupt:
            if not (out_dir / JOURNAL_NAME).exists():
                return ReproResult(
                    scenario, Reproduction.INCONCLUSIVE, ("interrupted",), None, target=url
                )
            ended = "interrupted"
        return _finish(scenario, url, out_dir, reports, ended, why, keep_raw_evidence, display)


def _finish(
    scenario: Scenario,
    url: str | None,
    out_dir: Path,
    reports: list[StepReport],
    ended: str,
    why: tuple[str, ...],
    keep_raw_evidence: bool,
    display: ProgressDisplay,
) -> ReproResult:
    rendered = wiring.render(out_dir, keep_raw_evidence=keep_raw_evidence, display=display)
    # the journal is the record: findings counted there include the timing detector's
    # end-of-run ones, which no step saw
    findings = rendered.summary["counts"]["findings"]
    verdict, reasons = judge(scenario.expect, findings, reports, ended)
    return ReproResult(
        scenario=scenario,
        verdict=verdict,
        reasons=(*why, *reasons),
        out_dir=out_dir,
        target=url,
        findings={k: int(n) for k, n in findings.items() if n},
        steps=tuple(reports),
        outputs=dict(rendered.paths),
        render_errors=dict(rendered.errors),
    )


@dataclass(frozen=True, slots=True)
class _Repro:
    """What a reproduction settled before the target was contacted."""

    scenario: Scenario
    out_dir: Path
    tenants: list[Tenant]
    display: ProgressDisplay
    keep_raw_evidence: bool
    transport: httpx.AsyncBaseTransport | None
    reports: list[StepReport]
    """Fills in as steps end (also when the run is cut short)."""


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What first contact with the target settled."""

    target: wiring.Contact
    planner: Planner
    calibration: PromptTokenOffset | None
    seed: int
    run_id: str


async def _run(repro: _Repro, base_url: str) -> str:
    """Send every step; returns how the run ended."""
    scenario, display = repro.scenario, repro.display
    max_in_flight = max((step.concurrency for step in scenario.send_steps), default=1)
    timeout_s = scenario.client.timeout_s
    async with wiring.http_client(max_in_flight, timeout_s, repro.transport) as http:
        prepared = await _prepare(repro, http, base_url)
        target, planner = prepared.target, prepared.planner
        client = wiring.target_client(http, target, timeout_s)
        await asyncio.to_thread(repro.out_dir.mkdir, parents=True, exist_ok=True, mode=0o700)
        journal = wiring.Journal(repro.out_dir, display)
        timing = TimingDetector()
        detectors = wiring.detectors(
            planner.index,
            target.limits,
            keep_raw_evidence=repro.keep_raw_evidence,
            timing=DeferredFinish(timing),
            calibration=prepared.calibration,
        )
        steps = Steps(
            scenario, planner, client, repro.tenants, detectors, journal.emit,
            repro.keep_raw_evidence, target.limits,
        )  # fmt: skip
        ended, message = "error", None
        try:
            journal.emit(
                wiring.run_started(
                    target,
                    run_id=prepared.run_id,
                    api="completions",
                    tenants=repro.tenants,
                    seed=prepared.seed,
                    minter=planner.minter,
                    settings=scenario.to_record(),
                )
            )
            display.note(f"journal: {journal.path}")
            with display:
                ended = await steps.run(display, repro.reports)
        except asyncio.CancelledError:
            ended, message = "interrupted", "the run was cancelled"
            raise
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if ended != "error":
                _finish_timing(timing, journal)
            journal.emit(RunFinished(ended, time.time(), steps.num_requests, message))
            journal.close()
        return ended


async def _prepare(repro: _Repro, http: httpx.AsyncClient, base_url: str) -> _Prepared:
    """Contact, limits, tokenizer, calibration and the planner."""
    scenario, display = repro.scenario, repro.display
    spec = scenario.limits
    target = await wiring.contact(
        http,
        base_url,
        repro.tenants[0],
        pool_tokens=spec.pool_tokens,
        context_tokens=spec.context_tokens,
        page_size=spec.page_size,
        model=scenario.client.model,
        how_to_name_model=f"set [client] model in {scenario.source}",
        display=display,
    )
    _check_sizes(scenario, target.limits)
    seed = scenario.seed
    seed = seed if seed is not None else random.SystemRandom().randrange(2**32)
    run_id = new_run_id()
    tokenizer = wiring.local_tokenizer(
        scenario.client.tokenizer, f"{scenario.source}: [client] tokenizer"
    )
    calibration = await wiring.calibrate(
        http,
        target,
        "completions",
        tokenizer,
        repro.tenants[0],
        chat_overhead_tokens=0,
        display=display,
    )
    limits = planning_limits(target.limits, calibration)
    planner = _planner(scenario, repro.tenants, tokenizer, limits, seed, run_id)
    return _Prepared(target, planner, calibration, seed, run_id)


def _finish_timing(timing: TimingDetector, journal: wiring.Journal) -> None:
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


def _planner(
    scenario: Scenario,
    tenants: list[Tenant],
    tokenizer: Tokenizer,
    limits: Limits,
    seed: int,
    run_id: str,
) -> Planner:
    sizes = {kind: [s for step in scenario.send_steps if step.kind == kind for s in step.sizes]
             for kind in ("victims", "probes", "disconnect")}  # fmt: skip
    profile = WorkloadProfile(
        name=f"scenario:{scenario.name}",
        description=scenario.summary,
        victims=sizes["victims"],
        probes=[*sizes["probes"], *sizes["disconnect"]],
    )
    return Planner(
        tenants,
        profile,
        tokenizer,
        wiring.canary_minter(seed, run_id, seeded=scenario.seed is not None),
        limits,
        api="completions",
        page_size=limits.page_size,
        seed=seed,
    )


__all__ = ["ReproResult", "StepReport", "judge", "run_repro"]
