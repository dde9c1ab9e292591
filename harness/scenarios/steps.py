"""A scenario's steps, sent in order: one runner per send step, waits, cache probe steps.

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import Event, Limits, PhaseStarted, RunFinished
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import Observation, TextSink
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.harness.run.arrivals import ClosedLoop
from kvcanary.harness.run.probe_phase import run_probe_phase
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.runner import Budget, Detectors, Phase, Runner, Sender, Workload
from kvcanary.harness.scenarios.judge import StepReport
from kvcanary.harness.scenarios.schema import CacheProbeStep, Scenario, SendStep, Step, WaitStep
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.planner import Planner
from kvcanary.tenants.tenant import Tenant


class Steps:
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
            display.note(f"step {number}/{num_steps}: {describe(step)}")
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
        from kvcanary.harness.cache_probe.probe import settings_for

        names = step.tenants or tuple(self.tenants)
        fields: dict[str, object] = {"num_trials": step.trials, "seed": self.planner.seed}
        if step.prompt_tokens is not None:
            fields["num_prompt_tokens"] = step.prompt_tokens
        try:
            settings = settings_for(self.limits, prefix_fraction=step.prefix_fraction, **fields)
            result, num_requests = await run_probe_phase(
                self.client,
                [self.tenants[n] for n in names],
                self.planner.tokenizer,
                settings,
                salts=step.salts,
                emit=self.emit,
                display=display,
            )
        except ConfigError as exc:
            raise ConfigError(f"{self.scenario.where(step, 'prompt_tokens')}: {exc}") from None
        self.num_requests += num_requests
        failed = sum(o.ttft_ms is None for o in result.outcomes)
        return StepReport(
            number,
            step,
            num_requests=num_requests,
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


class DeferredFinish:
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

    @property
    def not_judged(self) -> str | None:
        return self._timing.not_judged


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
        on_text: TextSink,
    ) -> Observation:
        chunks: list[str] = []

        def seen(chunk: str, field: str = "content") -> None:
            chunks.append(chunk)
            on_text(chunk, field)

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


def describe(step: Step) -> str:
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
