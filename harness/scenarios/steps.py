"""A scenario's steps, sent in order: one runner per send step, waits, cache probe steps.

Why one `Runner` per step: the runner's phases are shares of one budget whose intents are
interleaved by weighted round robin, while a scenario's steps are strict blocks (every
victim answered before the first probe is sent; a disconnect finished before the next owner
arrives). Each send step is therefore one runner over a one-phase workload with a budget of
the step's `count`, sharing the run's journal, canary index and detectors; a `wait` step
sleeps between them. The runners' own `run_finished` records are held back by the journal
(`harness.run.run_journal`) and one is written at the end, and the timing detector's
end-of-run re-evaluation runs once, after the last step.

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
from collections import Counter
from collections.abc import Iterator

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import PhaseStarted
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import Observation, TextSink
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.harness.run.arrivals import ClosedLoop
from kvcanary.harness.run.assembly import Assembly
from kvcanary.harness.run.phases import Budget, Phase, Workload
from kvcanary.harness.run.probe_phase import run_probe_phase
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.runner import Runner
from kvcanary.harness.run.seams import Sender
from kvcanary.harness.scenarios.judge import StepReport
from kvcanary.harness.scenarios.schema import CacheProbeStep, Scenario, SendStep, Step, WaitStep
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant


class Steps:
    """Runs a scenario's steps in order, one runner per send step, on the composed run."""

    def __init__(self, scenario: Scenario, run: Assembly, display: ProgressDisplay) -> None:
        self.scenario = scenario
        self.assembly = run
        self.planner = run.planner
        self.display = display
        tenants = run.blueprint.tenants
        self.tenants = {t.name: t for t in tenants}
        self.tenant_index = {t.name: i for i, t in enumerate(tenants)}
        self.emit = run.journal.emit
        self.num_requests = 0

    async def run(self, reports: list[StepReport]) -> str:
        num_steps = len(self.scenario.steps)
        for number, step in enumerate(self.scenario.steps, start=1):
            self.display.note(f"step {number}/{num_steps}: {describe(step)}")
            if isinstance(step, WaitStep):
                self.emit(PhaseStarted(step.name, t_wall=time.time()))
                await asyncio.sleep(step.seconds)
                reports.append(StepReport(number, step))
                continue
            if isinstance(step, CacheProbeStep):
                reports.append(await self._cache_probe(number, step))
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

    async def _cache_probe(self, number: int, step: CacheProbeStep) -> StepReport:
        from kvcanary.harness.cache_probe.probe import settings_for

        names = step.tenants or tuple(self.tenants)
        fields: dict[str, object] = {"num_trials": step.trials, "seed": self.planner.seed}
        if step.prompt_tokens is not None:
            fields["num_prompt_tokens"] = step.prompt_tokens
        run = self.assembly
        try:
            settings = settings_for(
                run.target.limits, prefix_fraction=step.prefix_fraction, **fields
            )
            result, num_requests = await run_probe_phase(
                run.client,
                [self.tenants[n] for n in names],
                self.planner.tokenizer,
                settings,
                salts=step.salts,
                emit=self.emit,
                display=self.display,
                counters=run.cache_counters(),
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
            findings=dict(Counter(str(f.kind) for f in result.findings)),
            probe_verdict=result.verdict,
            probe_reasons=result.assessment.reasons,
        )

    def _runner(self, step: SendStep) -> Runner:
        run = self.assembly
        sender: Sender = run.client
        if step.after_seconds is not None:
            sender = _DropAfter(run.client, step.after_seconds)
        return Runner(
            sender=sender,
            tenants=self.tenants,
            workload=Workload(
                {step.intent: self._plans(step)}, [Phase(step.name, 1.0, {step.intent: 1.0})]
            ),
            index=self.planner.index,
            detectors=run.detectors,
            emit=self.emit,  # the journal holds each step's run_finished: the run writes one
            pacing=ClosedLoop(step.concurrency),
            budget=Budget(num_requests=step.count),
            keep_raw_evidence=run.blueprint.keep_raw_evidence,
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
