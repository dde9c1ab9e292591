"""`kvcanary repro`: run a scenario's ordered steps, then judge what was found against it.

The wiring is `kvcanary run`'s (see `harness.run.session`): tenants and their credential
variables first; the target, or the scenario's bundled engine on a free loopback port; the
target's limits (the scenario's figures first) and model; the planner, target client and
the three detectors; the journal (`run_started` first); finally `reports.render_run`, so a
reproduction leaves the same evidence bundle (journal, summary, reports, `evidence/`) as a
run and can be re-rendered with `kvcanary report`.

Why one `Runner` per step: the runner's phases are shares of one budget whose intents are
interleaved by weighted round robin, while a scenario's steps are strict blocks (every
victim answered before the first probe is sent; a disconnect finished before the next owner
arrives). Each send step is therefore one runner over a one-phase workload with a budget of
the step's `count`, sharing the run's journal, canary index and detectors; a `wait` step
sleeps between them. The runner's own `run_finished` is held back and one is written at the
end, and the timing detector's end-of-run re-evaluation runs once, after the last step.

A `disconnect` step with `after_seconds` wraps the client: the connection is dropped that
long after sending, whether or not the response has begun. That reaches a request still
being prefilled even on a target that sends its response headers only with the first token
(as SGLang and the bundled engine do), which `after_chunks = 0` cannot.

Verdicts (`judge`): `reproduced` when the expectation was met (for a `clean` control: no
finding and every step did its job), `not reproduced` when the run did its job and the
outcome differs (an expected finding kind is missing, a forbidden one appeared, a clean
control leaked), `inconclusive` when the target could not be reached or steps failed in a
way that could hide the outcome (transport errors, no victim accepted, interrupted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal

import httpx

from canaries import CanaryError, CanaryMinter, load_tokenizer
from canaries.errors import ConfigError, RunIncomplete
from harness.detectors.content import ContentDetector
from harness.detectors.protocol import ProtocolDetector
from harness.detectors.timing import TimingDetector
from harness.record.events import (
    Event,
    FindingRecorded,
    Limits,
    PhaseStarted,
    RunFinished,
    RunStarted,
)
from harness.record.finding import Finding
from harness.record.journal import JOURNAL_NAME, JournalWriter, journal_segments
from harness.record.observation import Observation
from harness.record.ttft_model import TtftModel
from harness.run.arrivals import ClosedLoop
from harness.run.out_dir import default_out_dir
from harness.run.progress import ProgressDisplay
from harness.run.runner import Budget, Detectors, Phase, Runner, RunOutcome, Sender, Workload
from harness.run.session import MAX_RESPONSE_BYTES
from harness.scenarios.schema import (
    CacheProbeStep,
    EngineSpec,
    Expectation,
    Scenario,
    SendStep,
    Step,
    WaitStep,
)
from harness.target.client import TargetClient, make_http_client
from harness.target.limits import limits_from_facts
from harness.target.server_info import read_engine_facts
from tenants.plan import RequestPlan
from tenants.planner import Planner
from tenants.tenant import Tenant
from tenants.workload import WorkloadProfile

Verdict = Literal["reproduced", "not reproduced", "inconclusive"]
EXIT_BY_VERDICT: Mapping[Verdict, int] = {"reproduced": 0, "not reproduced": 1, "inconclusive": 3}
FAILURES = ("connect", "timeout", "protocol", "truncated", "too_large", "cancelled")
"""Error kinds that mean a request did not do its job (rejections and intended drops do)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one step sent and saw."""

    number: int
    step: Step
    num_requests: int = 0
    num_ok: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    """Observations by error kind (`http_status` is a rejection, `disconnected` a drop)."""
    findings: Mapping[str, int] = field(default_factory=dict)
    ended: str = "completed"
    probe_verdict: str | None = None
    """A cache_probe step's verdict: `found`, `not_found` or `unverifiable`."""
    probe_reasons: tuple[str, ...] = ()

    @classmethod
    def of(cls, number: int, step: Step, outcome: RunOutcome) -> StepReport:
        return cls(
            number=number,
            step=step,
            num_requests=outcome.num_requests,
            num_ok=outcome.num_observations - sum(outcome.errors.values()),
            errors=dict(outcome.errors),
            findings=dict(outcome.findings),
            ended=outcome.reason,
        )

    @property
    def label(self) -> str:
        return f"step {self.number} ({self.step.name})"


@dataclass(frozen=True, slots=True)
class ReproResult:
    """A reproduction's verdict, why, and where its evidence is."""

    scenario: Scenario
    verdict: Verdict
    reasons: tuple[str, ...]
    out_dir: Path | None
    """The evidence bundle; None when nothing was sent (target unreachable)."""
    target: str | None = None
    findings: Mapping[str, int] = field(default_factory=dict)
    steps: tuple[StepReport, ...] = ()
    outputs: Mapping[str, Path] = field(default_factory=dict)
    render_errors: Mapping[str, str] = field(default_factory=dict)

    @property
    def exit_status(self) -> int:
        """0 reproduced, 1 not reproduced, 3 inconclusive (2 is a usage error, raised)."""
        return EXIT_BY_VERDICT[self.verdict]


# -- the verdict -----------------------------------------------------------------------


def judge(
    expect: Expectation, findings: Mapping[str, int], steps: Sequence[StepReport], ended: str
) -> tuple[Verdict, tuple[str, ...]]:
    """Compare what a run found with what its scenario expects."""
    found = {kind: n for kind, n in findings.items() if n}
    problems = _problems(steps, ended)
    num_requests = sum(s.num_requests for s in steps)
    if expect.outcome == "clean":
        if found:
            return "not reproduced", (f"the clean control leaked: {_counts(found)}",)
        if problems:
            return "inconclusive", problems
        return "reproduced", (f"clean as expected: no finding in {num_requests} request(s)",)
    forbidden = [kind for kind in expect.must_not_include if kind in found]
    if forbidden:
        return "not reproduced", (
            f"found {', '.join(forbidden)}, which the scenario says must not appear "
            f"(all findings: {_counts(found)})",
        )
    missing = [str(kind) for kind in expect.must_include if kind not in found]
    if not expect.must_include and not found:
        missing = ["any"]
    if not missing:
        return "reproduced", (f"expected leak seen: {_counts(found)}",)
    absent = f"no {' / '.join(missing)} finding in {num_requests} request(s)"
    if found:
        absent += f" (found only {_counts(found)})"
    if problems:
        return "inconclusive", (absent, *problems)
    return "not reproduced", (f"the expected leak did not happen: {absent}",)


def _problems(steps: Sequence[StepReport], ended: str) -> tuple[str, ...]:
    """Why a step may not have done its job."""
    problems = []
    if ended != "completed":
        problems.append(f"the run ended early ({ended}) after {len(steps)} step(s)")
    for report in steps:
        step = report.step
        if isinstance(step, CacheProbeStep) and report.probe_verdict == "unverifiable":
            problems.append(f"{report.label}: isolation unverifiable: {report.probe_reasons[0]}")
        if not isinstance(step, SendStep):
            continue
        failed = {kind: n for kind, n in report.errors.items() if kind in FAILURES}
        if failed:
            problems.append(
                f"{report.label}: {sum(failed.values())} of {report.num_requests} request(s) "
                f"failed ({_counts(failed)})"
            )
        if step.kind == "victims" and report.num_requests and report.num_ok == 0:
            problems.append(f"{report.label}: no victim was accepted, so nothing could leak")
    return tuple(problems)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


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
    for tenant in tenants:
        tenant.auth_headers()  # a missing credential variable is a usage error, before any I/O
    url = target or scenario.target
    if url is None and scenario.engine is None:
        raise ConfigError(f"scenario {scenario.name} runs against a deployment: pass --target URL")
    out_dir = _out_dir(out)
    display = ProgressDisplay(num_requests=scenario.num_requests, file=file, live=live)
    display.note(f"scenario {scenario.name}: expects {scenario.expect.describe()}")
    if url is not None and scenario.engine is not None:
        display.note(
            f"--target given: the scenario's [engine] ({scenario.engine.preset}) is not used"
        )
    reports: list[StepReport] = []
    ended = "completed"
    why: tuple[str, ...] = ()
    try:
        if url is not None:
            ended = asyncio.run(
                _run(
                    scenario, url, out_dir, tenants, display, keep_raw_evidence, transport, reports
                )
            )
        else:
            assert scenario.engine is not None
            with _bundled_engine(scenario.engine, display, engine_processes) as url:
                ended = asyncio.run(
                    _run(
                        scenario, url, out_dir, tenants, display, keep_raw_evidence, transport,
                        reports,
                    )
                )  # fmt: skip
    except RunIncomplete as exc:
        if not (out_dir / JOURNAL_NAME).exists():
            return ReproResult(scenario, "inconclusive", (str(exc),), None, target=url)
        ended, why = "error", (str(exc),)
    except KeyboardInterrupt:
        if not (out_dir / JOURNAL_NAME).exists():
            return ReproResult(scenario, "inconclusive", ("interrupted",), None, target=url)
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
    from reports.render import render_run

    rendered = render_run(out_dir, keep_raw_evidence=keep_raw_evidence)
    for name, error in rendered.errors.items():
        display.note(f"report output {name} could not be written: {error}")
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


def _out_dir(out: str | Path | None) -> Path:
    out_dir = Path(out) if out is not None else default_out_dir()
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and journal_segments(out_dir):
        raise ConfigError(f"--out {out_dir} already holds a run; choose another directory")
    return out_dir


@contextlib.contextmanager
def _bundled_engine(spec: EngineSpec, display: ProgressDisplay, processes: bool) -> Iterator[str]:
    from reference_engine.server.launch import running_engine

    settings = ", ".join(
        [*(f"fix {fix}" for fix in spec.fixes), *(f"{k}={v}" for k, v in spec.overrides.items())]
    )
    display.note(f"starting the bundled engine ({spec.preset}{': ' if settings else ''}{settings})")
    with running_engine(
        spec.preset, fixes=spec.fixes, processes=processes, **spec.overrides
    ) as engine:
        display.note(f"engine listening at {engine.base_url}")
        yield str(engine.base_url)


async def _run(
    scenario: Scenario,
    base_url: str,
    out_dir: Path,
    tenants: list[Tenant],
    display: ProgressDisplay,
    keep_raw_evidence: bool,
    transport: httpx.AsyncBaseTransport | None,
    reports: list[StepReport],
) -> str:
    """Send every step; returns how the run ended. `reports` fills in as steps end."""
    max_in_flight = max((step.concurrency for step in scenario.send_steps), default=1)
    timeout = httpx.Timeout(connect=10.0, read=scenario.client.timeout_s, write=60.0, pool=None)
    if transport is None:
        http = make_http_client(max_concurrency=max_in_flight, timeout=timeout)
    else:
        http = httpx.AsyncClient(transport=transport, timeout=timeout)
    async with http:
        facts = await read_engine_facts(http, base_url, headers=tenants[0].auth_headers())
        if not facts.reachable:
            errors = [a.error for a in facts.attempts if a.error]
            why = errors[0] if errors else "no response"
            raise RunIncomplete(f"cannot reach the target at {base_url}: {why}")
        spec = scenario.limits
        limits = limits_from_facts(
            facts,
            pool_tokens=spec.pool_tokens,
            context_tokens=spec.context_tokens,
            page_size=spec.page_size,
        )
        model = scenario.client.model or facts.model
        if model is None:
            raise ConfigError(
                f"{base_url}/v1/models lists no model; set [client] model in {scenario.source}"
            )
        display.note(
            f"target {base_url} ({facts.engine}), model {model}: pool {limits.pool_tokens} "
            f"tokens, context {limits.context_tokens}, page {limits.page_size} [{limits.source}]"
        )
        _check_sizes(scenario, limits)
        seed = scenario.seed
        seed = seed if seed is not None else random.SystemRandom().randrange(2**32)
        run_id = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"
        planner = _planner(scenario, tenants, limits, seed, run_id)
        client = TargetClient(
            http,
            base_url,
            model=model,
            max_response_bytes=MAX_RESPONSE_BYTES,
            deadline_s=scenario.client.timeout_s,
        )
        await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True, mode=0o700)
        journal = JournalWriter(out_dir / JOURNAL_NAME)

        def emit(event: Event) -> None:
            journal.write(event)
            display.handle(event)

        timing = TimingDetector()
        detectors = Detectors(
            ContentDetector(planner.index, redact_excerpts=not keep_raw_evidence),
            ProtocolDetector(limits),
            _DeferredFinish(timing),
        )
        steps = _Steps(
            scenario, planner, client, tenants, detectors, emit, keep_raw_evidence, limits
        )
        ended, message = "error", None
        try:
            emit(_run_started(scenario, base_url, model, limits, tenants, seed, run_id, planner))
            display.note(f"journal: {journal.path}")
            with display:
                ended = await steps.run(display, reports)
        except asyncio.CancelledError:
            ended, message = "interrupted", "the run was cancelled"
            raise
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if ended != "error":
                for finding in timing.finish():
                    emit(FindingRecorded(finding, t_wall=time.time()))
            emit(RunFinished(ended, time.time(), steps.num_requests, message))
            journal.close()
        return ended


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
    limits: Limits,
    seed: int,
    run_id: str,
) -> Planner:
    client = scenario.client
    try:
        tokenizer = load_tokenizer(client.tokenizer)
    except CanaryError as exc:
        raise ConfigError(
            f"{scenario.source}: [client] tokenizer {client.tokenizer}: {exc}"
        ) from None
    sizes = {kind: [s for step in scenario.send_steps if step.kind == kind for s in step.sizes]
             for kind in ("victims", "probes", "disconnect")}  # fmt: skip
    profile = WorkloadProfile(
        name=f"scenario:{scenario.name}",
        description=scenario.summary,
        victims=sizes["victims"],
        probes=[*sizes["probes"], *sizes["disconnect"]],
    )
    minter = (
        CanaryMinter.random() if scenario.seed is None else CanaryMinter.from_seed(seed, run_id)
    )
    return Planner(
        tenants,
        profile,
        tokenizer,
        minter,
        limits,
        api="completions",
        page_size=limits.page_size,
        seed=seed,
    )


def _run_started(
    scenario: Scenario,
    base_url: str,
    model: str,
    limits: Limits,
    tenants: list[Tenant],
    seed: int,
    run_id: str,
    planner: Planner,
) -> RunStarted:
    from importlib import metadata

    return RunStarted(
        run_id=run_id,
        target=base_url,
        model=model,
        api="completions",
        limits=limits,
        tenants=tuple(t.to_record() for t in tenants),
        seed=seed,
        canary_key_id=planner.minter.key_id,
        settings=scenario.to_record(),
        versions={"kvcanary": metadata.version("kvcanary"), "httpx": httpx.__version__},
        t_wall=time.time(),
    )


class _Steps:
    """Runs a scenario's steps in order, one runner per send step."""

    def __init__(
        self,
        scenario: Scenario,
        planner: Planner,
        client: TargetClient,
        tenants: list[Tenant],
        detectors: Detectors,
        emit: Callable[[Event], None],
        keep_raw_evidence: bool,
        limits: Limits,
    ) -> None:
        self.scenario = scenario
        self.limits = limits
        self.planner = planner
        self.client = client
        self.tenants = {t.name: t for t in tenants}
        self.tenant_index = {t.name: i for i, t in enumerate(tenants)}
        self.detectors = detectors
        self.emit = emit
        self.keep_raw_evidence = keep_raw_evidence
        self.num_requests = 0

    async def run(self, display: ProgressDisplay, reports: list[StepReport]) -> str:
        num_steps = len(self.scenario.steps)
        for number, step in enumerate(self.scenario.steps, start=1):
            display.note(f"step {number}/{num_steps}: {_describe(step)}")
            if isinstance(step, WaitStep):
                self.emit(PhaseStarted(step.name, t_wall=time.time()))
                await asyncio.sleep(step.seconds)
                reports.append(StepReport(number, step))
                continue
            if isinstance(step, CacheProbeStep):
                reports.append(await self._cache_probe(number, step, display))
                continue
            runner = self._runner(step)
            try:
                outcome = await runner.run()  # raises a ConfigError itself, not its task group
            finally:
                self.num_requests += runner.outcome.num_requests
                reports.append(StepReport.of(number, step, runner.outcome))
            if outcome.reason != "completed":
                return outcome.reason
        return "completed"

    async def _cache_probe(
        self, number: int, step: CacheProbeStep, display: ProgressDisplay
    ) -> StepReport:
        from harness.cache_probe.probe import CacheProbe, design_trials, probe_tenants, settings_for

        names = step.tenants or tuple(self.tenants)
        tenants = probe_tenants([self.tenants[n] for n in names], salts=step.salts)
        fields: dict[str, object] = {"num_trials": step.trials, "seed": self.planner.seed}
        if step.prompt_tokens is not None:
            fields["num_prompt_tokens"] = step.prompt_tokens
        try:
            settings = settings_for(self.limits, prefix_fraction=step.prefix_fraction, **fields)
            design = await asyncio.to_thread(
                design_trials, tenants, self.planner.tokenizer, settings
            )
        except ConfigError as exc:
            raise ConfigError(f"{self.scenario.where(step, 'prompt_tokens')}: {exc}") from None
        result = await CacheProbe(self.client, design, emit=self.emit).run()
        self.num_requests += design.num_requests
        display.note(f"cache probe: {result.verdict}: {'; '.join(result.assessment.reasons)}")
        failed = sum(o.ttft_ms is None for o in result.outcomes)
        return StepReport(
            number,
            step,
            num_requests=design.num_requests,
            num_ok=len(result.outcomes) - failed,
            findings={"shared_prefix_cache": len(result.findings)} if result.findings else {},
            probe_verdict=result.verdict,
            probe_reasons=result.assessment.reasons,
        )

    def _runner(self, step: SendStep) -> Runner:
        sender: Sender = self.client
        if step.after_seconds is not None:
            sender = _DropAfter(self.client, step.after_seconds)
        return Runner(
            sender=sender,
            tenants=self.tenants,
            workload=Workload(
                {step.intent: self._plans(step)}, [Phase(step.name, 1.0, {step.intent: 1.0})]
            ),
            index=self.planner.index,
            detectors=self.detectors,
            emit=self._emit_held,
            pacing=ClosedLoop(step.concurrency),
            budget=Budget(num_requests=step.count),
            keep_raw_evidence=self.keep_raw_evidence,
            num_previous_requests=self.num_requests,
        )

    def _plans(self, step: SendStep) -> Iterator[RequestPlan]:
        for i in range(step.count):
            size = step.sizes[i % len(step.sizes)]
            if step.tenants:
                tenant = self.tenant_index[step.tenants[i % len(step.tenants)]]
            else:
                tenant = self.planner.next_tenant()
            try:
                plan = self.planner.plan(step.name, step.intent, size, tenant)
            except ConfigError as exc:
                key = "size" if step.kind == "disconnect" else "sizes"
                raise ConfigError(f"{self.scenario.where(step, key)}: {exc}") from None
            yield dataclasses.replace(
                plan, max_tokens=step.max_tokens, disconnect_after_chunks=step.after_chunks
            )

    def _emit_held(self, event: Event) -> None:
        """Every event but a step's `run_finished`: the run has one, written at its end."""
        if not isinstance(event, RunFinished):
            self.emit(event)


class _DeferredFinish:
    """The timing detector for one step: observes, but leaves the end-of-run pass to the run."""

    def __init__(self, timing: TimingDetector) -> None:
        self._timing = timing

    def observe(self, plan: RequestPlan, obs: Observation) -> list[Finding]:
        return self._timing.observe(plan, obs)

    def finish(self) -> list[Finding]:
        return []

    @property
    def model(self) -> TtftModel | None:
        return self._timing.model


class _DropAfter:
    """A sender that drops each connection `seconds` after sending it (a client giving up)."""

    def __init__(self, sender: TargetClient, seconds: float) -> None:
        self._sender = sender
        self._seconds = seconds

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: Callable[[str], None],
    ) -> Observation:
        chunks: list[str] = []

        def seen(chunk: str) -> None:
            chunks.append(chunk)
            on_text(chunk)

        t_wall, t_sent_ns = time.time(), time.perf_counter_ns()
        try:
            async with asyncio.timeout(self._seconds):
                return await self._sender.send(
                    plan, tenant, t_scheduled_ns=t_scheduled_ns, on_text=seen
                )
        except TimeoutError:
            text = "".join(chunks)
            return Observation(
                request_id=plan.request_id,
                tenant=plan.tenant,
                status=None,
                t_wall=t_wall,
                t_scheduled_ns=t_scheduled_ns,
                t_sent_ns=t_sent_ns,
                t_done_ns=time.perf_counter_ns(),
                text=text,
                text_sha256=hashlib.sha256(text.encode()).hexdigest(),
                num_text_chars=len(text),
                num_chunks=len(chunks),
                error_kind="disconnected",
                error=f"dropped by the harness {self._seconds:g} s after sending "
                f"({len(chunks)} chunk(s) received)",
            )


def _describe(step: Step) -> str:
    if isinstance(step, WaitStep):
        return f"wait {step.seconds:g} s"
    if isinstance(step, CacheProbeStep):
        who = f" over {', '.join(step.tenants)}" if step.tenants else ""
        salts = ", each tenant salted" if step.salts else ""
        return f"cache probe{who}, {step.trials} trials per arm{salts}"
    sizes = ", ".join(s.expr for s in step.sizes)
    text = f"{step.count} {step.kind} ({sizes})"
    if step.tenants:
        text += f" from {', '.join(step.tenants)}"
    if step.after_chunks is not None:
        text += f", dropped after {step.after_chunks} chunk(s)"
    if step.after_seconds is not None:
        text += f", dropped after {step.after_seconds:g} s"
    return text + (f", {step.concurrency} at a time" if step.concurrency > 1 else "")


__all__ = ["EXIT_BY_VERDICT", "ReproResult", "StepReport", "Verdict", "judge", "run_repro"]
