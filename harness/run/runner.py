"""The runner: sends planned requests in phases, feeds the detectors, journals everything.

A run is a sequence of phases over a budget (a request count or a duration):

    fill    victims only: canary-laced prompts a safe target accepts fill its KV pool
    probe   probes at and above the pool and context limits, interleaved with continuing
            victim traffic so that stale pages always hold fresh canaries
    abort   abort plans (the client drops the connection mid-stream) mixed with victims and
            probes, which exercises the release path while pages are still being written

Within a phase, intents are interleaved by smooth weighted round robin, so a 3:1 mix sends
`victim victim probe victim ...` rather than bursts. Requests start either from `N`
closed-loop workers or at Poisson arrival times on an absolute clock (`harness.run.arrivals`),
their plans built a batch ahead (`harness.run.plan_feed`), so N workers keep N in flight.

For every request, in this order: its canaries join the live index with their owner; the
plan is journaled (before anything is sent, so a killed run loses at most what was in
flight); each streamed chunk goes to the content detector, whose findings are journaled as
they appear; the observation is journaled with its text redacted to the canary spans and the
target's words in its error to a marker (unless raw evidence was asked for); then the
protocol and timing detectors' findings (but a high `unsafe_accept` whose answer the timing
detector judges only at the end of the run, which is journaled after that final pass, made
critical by a `fast_prefill` it finds); then `target_unhealthy` / `target_serving` when the
target stopped / resumed serving (`harness.run.health`; `RunOutcome.target_unhealthy` keeps
the declaration).

With a cost guard (`admit`), the first plan it refuses ends the run cleanly, reason
`budget_spent`: requests in flight finish, nothing more is sent.

`stop()` (the first Ctrl-C) stops sending and gives requests in flight `grace_s` to finish
before cancelling them; `cancel()` (the second) cancels them at once. Either way the run ends
with `run_finished` (reason `interrupted`); cancelled requests are journaled as observations
with `error_kind="cancelled"`.

With a `RemoteSender` (`--ray`: `harness.run.ray_sender`) plans are drawn here, built, sent
and scanned elsewhere; the plan is journaled when it comes back, with its content findings and
its observation, and judged from there on as above (`harness.run.settle`).

It deliberately does not build plans, talk HTTP, render reports or print: those are the
planner, the target client, `reports` and `harness.run.progress`, wired by `harness.run.session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from kvcanary.harness.record.events import Event, PlanRecorded, RunFinished
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run.arrivals import Clock, ClosedLoop, MonotonicClock, Pacing, PoissonArrivals
from kvcanary.harness.run.live_plans import LivePlans
from kvcanary.harness.run.outcome import RunOutcome
from kvcanary.harness.run.phases import Budget, Phase, Workload, default_phases
from kvcanary.harness.run.plan_feed import PlanFeed
from kvcanary.harness.run.seams import (
    CanaryRegistry,
    ContentScanner,
    Detectors,
    PlanChecker,
    RemoteSender,
    ResponseScan,
    Sender,
    TimingChecker,
    unanswered,
)
from kvcanary.harness.run.settle import Settler, journaled_form, shown_form
from kvcanary.harness.target.health_route import HealthProbe
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant, all_secrets

DEFAULT_GRACE_S = 5.0


HEALTH_EVERY_S = 2.0
"""How often the target's health route is polled during a run (where it has one)."""


class Runner:
    """Runs one workload against one target; see the module docstring for the order of events."""

    def __init__(
        self,
        *,
        sender: Sender | RemoteSender,
        tenants: Mapping[str, Tenant],
        workload: Workload,
        index: CanaryRegistry,
        detectors: Detectors,
        emit: Callable[[Event], None],
        pacing: Pacing,
        budget: Budget,
        keep_raw_evidence: bool = False,
        grace_s: float = DEFAULT_GRACE_S,
        clock: Clock | None = None,
        num_previous_requests: int = 0,
        elapsed_before_s: float = 0.0,
        admit: Callable[[RequestPlan], bool] | None = None,
        health_probe: HealthProbe | None = None,
        health_every_s: float = HEALTH_EVERY_S,
        emit_line: Callable[[Event, bytes], None] | None = None,
    ) -> None:
        """`emit_line` journals an event a `RemoteSender` encoded already (with its line)."""
        self._sender = sender
        self._remote = sender if isinstance(sender, RemoteSender) else None
        self._tenants = dict(tenants)
        self._secrets = all_secrets(self._tenants.values())
        """Credential values of every tenant: scrubbed from whatever the target sends back."""
        self._detectors = detectors
        self._emit_event = emit
        self._emit_line = emit_line
        self._pacing = pacing
        self._budget = budget
        self._keep_raw_evidence = keep_raw_evidence
        self._settler = Settler(detectors, self._emit)
        self._health_probe = health_probe
        """The target's `/health` route, polled every `health_every_s` while the run goes."""
        self._health_every_s = health_every_s
        self._grace_s = grace_s
        self._clock = clock or MonotonicClock()
        self._num_previous_requests = num_previous_requests
        # a resumed soak's earlier sessions: its duration and phase schedule continue; the
        # cost guard's meter (`tenants.cost.SpendMeter`): no to a plan ends the run
        self._feed = PlanFeed(
            workload,
            budget,
            self._clock,
            emit=self._emit,
            elapsed_before_s=elapsed_before_s,
            admit=admit,
            sketch=self._remote is not None and self._remote.builds_plans,
        )
        self._stopping = asyncio.Event()
        self._interrupted = False
        self._busy: set[asyncio.Task[None]] = set()
        self._live = LivePlans(index)
        self._grace: asyncio.TimerHandle | None = None
        self.outcome = RunOutcome("running", 0, 0)

    # -- control ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop sending; requests in flight get `grace_s` to finish, then are cancelled."""
        self._interrupted = True
        self._stopping.set()
        if self._grace is None:
            self._grace = asyncio.get_running_loop().call_later(self._grace_s, self.cancel)

    def cancel(self) -> None:
        """Stop sending and cancel every request in flight now."""
        self._interrupted = True
        self._stopping.set()
        for task in list(self._busy):
            task.cancel()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> RunOutcome:
        """Send the workload until the budget is spent or `stop()`; returns how it ended."""
        self._feed.t0_ns = self._clock.now_ns()
        message: str | None = None
        reason = "error"
        poller = None if self._health_probe is None else asyncio.create_task(self._poll_health())
        try:
            async with asyncio.TaskGroup() as group:
                if isinstance(self._pacing, ClosedLoop):
                    for _ in range(self._pacing.concurrency):
                        self._track(group.create_task(self._closed_loop_worker()))
                else:
                    group.create_task(self._open_loop_dispatcher(self._pacing, group))
            if self._interrupted:
                reason = "interrupted"
            elif self._feed.refused:
                reason = "budget_spent"
            else:
                reason = "duration" if self._budget.duration_s is not None else "completed"
        except asyncio.CancelledError:
            reason, message = "interrupted", "the run was cancelled"
            raise
        except BaseExceptionGroup as group:
            # One request's failure ends the run; the caller sees that failure itself (a
            # ConfigError stays a one-line usage error), not the task group around it.
            first = _first_leaf(group)
            message = f"{type(first).__name__}: {first}"
            raise first from None
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            if self._grace is not None:
                self._grace.cancel()
            self._settler.finish(judge=reason != "error")
            self.outcome.reason = reason
            self._emit(
                RunFinished(
                    reason=reason,
                    t_wall=time.time(),
                    num_requests=self._num_previous_requests + self.outcome.num_requests,
                    message=message,
                )
            )
        return self.outcome

    def _track(self, task: asyncio.Task[None]) -> None:
        self._busy.add(task)
        task.add_done_callback(self._busy.discard)

    async def _closed_loop_worker(self) -> None:
        while (plan := await self._take()) is not None:
            await self._execute(plan, self._clock.now_ns())

    async def _open_loop_dispatcher(
        self, pacing: PoissonArrivals, group: asyncio.TaskGroup
    ) -> None:
        slots = asyncio.Semaphore(pacing.max_in_flight)
        for t_arrival_ns in pacing.times(self._feed.t0_ns):
            # The plan is built before its arrival time so building it does not add slip.
            plan = await self._take(t_arrival_ns)
            if plan is None or not await self._wait_until(t_arrival_ns):
                return
            await slots.acquire()
            if self._stopping.is_set():
                return
            self._track(group.create_task(self._execute_and_release(plan, t_arrival_ns, slots)))

    async def _execute_and_release(
        self, plan: RequestPlan, t_scheduled_ns: int, slots: asyncio.Semaphore
    ) -> None:
        try:
            await self._execute(plan, t_scheduled_ns)
        finally:
            slots.release()

    async def _wait_until(self, t_ns: int) -> bool:
        """Sleep until `t_ns` on the run's clock; False if the run was stopped meanwhile."""
        if self._stopping.is_set():
            return False
        sleeper = asyncio.ensure_future(self._clock.sleep_until(t_ns))
        stopper = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((sleeper, stopper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopper.cancel()
        return not self._stopping.is_set()

    async def _take(self, t_ns: int | None = None) -> RequestPlan | None:
        """The next plan to send at `t_ns` (default: now), or None when spent or stopped
        (`harness.run.plan_feed`); the cost guard's first no stops the run cleanly."""
        plan = await self._feed.take(t_ns, self._stopping)
        if plan is None and self._feed.refused:
            self._stopping.set()
        return plan

    async def _execute(self, plan: RequestPlan, t_scheduled_ns: int) -> None:
        if self._remote is not None:
            await self._execute_elsewhere(self._remote, plan, t_scheduled_ns)
            return
        tenant = self._tenants[plan.tenant]
        self._live.register(plan)
        self._emit(PlanRecorded(plan))
        scan = self._detectors.content.start(plan)
        streamed: list[Finding] = []  # the protocol detector weighs them (unsafe_accept)

        def on_text(chunk: str, field: str = "content") -> None:
            for finding in scan.feed(chunk, field):
                streamed.append(finding)
                self._settler.emit_finding(finding)

        try:
            obs = await cast(Sender, self._sender).send(
                plan, tenant, t_scheduled_ns=t_scheduled_ns, on_text=on_text
            )
        except asyncio.CancelledError:
            self._observe(plan, scan, self._cancelled(plan, t_scheduled_ns), streamed)
            raise
        self._observe(plan, scan, obs, streamed)

    async def _execute_elsewhere(
        self, remote: RemoteSender, plan: RequestPlan, t_scheduled_ns: int
    ) -> None:
        """`plan` built, sent and scanned by `remote`; journaled and judged here."""
        try:
            done = await remote.execute(plan, t_scheduled_ns=t_scheduled_ns)
        except asyncio.CancelledError:
            built = remote.built(plan)
            self._emit(PlanRecorded(built))
            obs = self._cancelled(built, t_scheduled_ns)
            journaled, shown = journaled_form(
                obs, (), self._secrets, keep_raw_evidence=self._keep_raw_evidence
            )
            self._settler.settle(built, journaled, shown)
            raise
        self._emit(PlanRecorded(done.plan), done.plan_line)
        for finding in done.streamed:
            self._settler.emit_finding(finding)
        obs = done.observation
        self._settler.settle(
            done.plan,
            obs,
            shown_form(obs) if self._keep_raw_evidence else obs,
            streamed=done.streamed,
            content=done.content,
            echo=done.echo,
            line=done.observation_line,
        )

    async def _poll_health(self) -> None:
        """Poll the target's health route until the run ends (cancelled then)."""
        assert self._health_probe is not None
        while not self._stopping.is_set():
            await asyncio.sleep(self._health_every_s)
            t_polled = time.time()
            error = await self._health_probe()
            for event in self._settler.health.observe_health(error, t_polled, time.time()):
                self._emit(event)

    def _observe(
        self,
        plan: RequestPlan,
        scan: ResponseScan,
        obs: Observation,
        streamed: Sequence[Finding] = (),
    ) -> None:
        content = scan.finish(obs)
        journaled, shown = journaled_form(
            obs, scan.hits, self._secrets, keep_raw_evidence=self._keep_raw_evidence
        )
        echo = scan.own_echo_event(time.time())
        self._settler.settle(plan, journaled, shown, streamed=streamed, content=content, echo=echo)

    def _cancelled(self, plan: RequestPlan, t_scheduled_ns: int) -> Observation:
        why = "interrupted before the response finished"
        return unanswered(plan, t_scheduled_ns, self._clock.now_ns(), "cancelled", why)

    def _emit(self, event: Event, line: bytes | None = None) -> None:
        self.outcome.count(event)
        if line is None or self._emit_line is None:
            self._emit_event(event)
        else:
            self._emit_line(event, line)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


__all__ = [
    "DEFAULT_GRACE_S",
    "Budget",
    "CanaryRegistry",
    "ContentScanner",
    "Detectors",
    "Phase",
    "PlanChecker",
    "ResponseScan",
    "RunOutcome",
    "Runner",
    "Sender",
    "TimingChecker",
    "Workload",
    "default_phases",
]
