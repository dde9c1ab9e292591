"""The runner against fake targets: phases, pacing, journal order, interruption."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.canaries import Hit, Owner
from kvcanary.canaries.span import CanarySpan
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    Limits,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    RunFinished,
)
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.journal import JournalWriter, read_journal
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run.arrivals import ClosedLoop, PoissonArrivals
from kvcanary.harness.run.runner import Budget, Detectors, Phase, Runner, Workload, default_phases
from kvcanary.harness.target.client import TargetClient
from kvcanary.tenants.plan import Intent, RequestPlan
from kvcanary.tenants.tenant import Tenant

LIMITS = Limits(pool_tokens=1000, context_tokens=2000, page_size=16, source="flags")
CLOSED_LOOP = ClosedLoop(4)
BUDGET = Budget(num_requests=40)
PHASES = default_phases(0.75)
TENANTS = {t.name: t for t in (Tenant("tenant-0"), Tenant("tenant-1"))}


def plan_stream(intent: Intent, *, limit: int | None = None) -> Iterator[RequestPlan]:
    """Plans alternating between two tenants; probes are above the limit."""
    for i in itertools.count() if limit is None else range(limit):
        request_id = f"{intent}-{i}"
        tenant = f"tenant-{i % 2}"
        canary = f"<<{request_id}>>"
        yield RequestPlan(
            request_id=request_id,
            tenant=tenant,
            phase="unset",
            intent=intent,
            size_label="x",
            num_prompt_tokens=1500 if intent == "probe" else 100,
            expected="reject" if intent == "probe" else "accept",
            api="completions",
            prompt=f"{canary} prompt of {request_id}",
            canaries=(CanarySpan(canary, 0, 0, 0),),
            disconnect_after_chunks=1 if intent == "abort" else None,
        )


def streams(limit: int | None = None) -> dict[Intent, Iterator[RequestPlan]]:
    return {i: plan_stream(i, limit=limit) for i in ("victim", "probe", "abort")}


class SimClock:
    """A run's clock in simulated time: `sleep_until` jumps to the time asked for and a
    `FakeSender`'s delay is charged to it, so a duration budget is spent by the requests
    themselves, never by how busy the machine is."""

    def __init__(self) -> None:
        self.t_ns = 1_000_000_000

    def now_ns(self) -> int:
        return self.t_ns

    async def sleep_until(self, t_ns: int) -> None:
        self.t_ns = max(self.t_ns, t_ns)
        await asyncio.sleep(0)

    async def spend(self, seconds: float) -> None:
        self.t_ns += round(seconds * 1e9)
        await asyncio.sleep(0)


class FakeSender:
    """Answers every plan after `delay_s` (on `clock`, when given), streaming `chunks`;
    tracks concurrency."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        chunks: tuple[str, ...] = ("hello ", "world"),
        before: Callable[[RequestPlan], None] | None = None,
        clock: SimClock | None = None,
    ) -> None:
        self.clock = clock
        self.now_ns = clock.now_ns if clock is not None else time.perf_counter_ns
        self.delay_s = delay_s
        self.chunks = chunks
        self.before = before
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent: list[tuple[str, int, int]] = []

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: Callable[[str], None],
    ) -> Observation:
        assert plan.tenant == tenant.name
        t_sent_ns = self.now_ns()
        self.sent.append((plan.request_id, t_scheduled_ns, t_sent_ns))
        if self.before is not None:
            self.before(plan)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.clock is not None:
                await self.clock.spend(self.delay_s)
            else:
                await asyncio.sleep(self.delay_s)
            for chunk in self.chunks:
                on_text(chunk)
        finally:
            self.in_flight -= 1
        text = "".join(self.chunks)
        rejected = plan.expected == "reject"
        return Observation(
            request_id=plan.request_id,
            tenant=plan.tenant,
            status=400 if rejected else 200,
            t_wall=time.time(),
            t_scheduled_ns=t_scheduled_ns,
            t_sent_ns=t_sent_ns,
            t_first_token_ns=None if rejected else self.now_ns(),
            t_done_ns=self.now_ns(),
            text="" if rejected else text,
            error_kind="http_status" if rejected else None,
        )


class FakeScan:
    def __init__(self, plan: RequestPlan) -> None:
        self.plan = plan
        self.hits: list[Hit] = []

    def feed(self, chunk: str, field: str = "content") -> list[Finding]:
        if "LEAK" not in chunk:
            return []
        finding = Finding(
            FindingKind.CROSS_TENANT_CANARY,
            Severity.CRITICAL,
            "content",
            self.plan.request_id,
            self.plan.tenant,
            "leak",
        )
        return [finding]

    def own_echo_event(self, t_wall: float) -> None:
        return None

    def finish(self, obs: Observation) -> list[Finding]:
        return []


class FakeContent:
    def start(self, plan: RequestPlan) -> FakeScan:
        return FakeScan(plan)


class FakeIndex:
    """The live-index interface the runner uses, recording what it was told."""

    def __init__(self, max_live: int = 1 << 20) -> None:
        self.max_live = max_live
        self.owners: dict[str, tuple[str, str]] = {}
        self.discarded: list[str] = []

    def __len__(self) -> int:
        return len(self.owners)

    def add_many(self, items: Iterable[tuple[str, Owner]]) -> None:
        for text, owner in items:
            self.owners[text] = (owner.tenant, owner.request_id)

    def discard(self, canary: str) -> None:
        del self.owners[canary]
        self.discarded.append(canary)


def make_runner(
    sender: FakeSender | TargetClient,
    emit: Callable[[Event], None],
    *,
    pacing: ClosedLoop | PoissonArrivals = CLOSED_LOOP,
    budget: Budget = BUDGET,
    phases: tuple[Phase, ...] = PHASES,
    index: FakeIndex | None = None,
    grace_s: float = 5.0,
    workload_streams: dict[Intent, Iterator[RequestPlan]] | None = None,
    admit: Callable[[RequestPlan], bool] | None = None,
    clock: SimClock | None = None,
) -> Runner:
    return Runner(
        sender=sender,
        tenants=TENANTS,
        workload=Workload(workload_streams or streams(), phases),
        index=FakeIndex() if index is None else index,
        detectors=Detectors(FakeContent(), ProtocolDetector(LIMITS), TimingDetector()),
        emit=emit,
        pacing=pacing,
        budget=budget,
        grace_s=grace_s,
        admit=admit,
        clock=clock,
    )


def _plans(events: list[Event]) -> list[RequestPlan]:
    return [e.plan for e in events if isinstance(e, PlanRecorded)]


def _observations(events: list[Event]) -> list[Observation]:
    return [e.observation for e in events if isinstance(e, ObservationRecorded)]


# -- workload --------------------------------------------------------------------------


def test_workload_interleaves_intents_by_weight() -> None:
    workload = Workload(streams(), default_phases(0.75))
    probe = workload.phase_at(0.5)
    assert probe.name == "probe"
    intents = "".join(workload.next_plan(probe).intent[0] for _ in range(12))  # type: ignore[union-attr]
    assert intents.count("p") == 3
    assert "pp" not in intents  # spread out, never in bursts
    assert [workload.phase_at(f).name for f in (0.0, 0.149, 0.15, 0.79, 0.8, 0.999)] == [
        "fill",
        "fill",
        "probe",
        "probe",
        "abort",
        "abort",
    ]


def test_exhausted_streams_drop_out_then_the_workload_ends() -> None:
    workload = Workload(
        {"victim": plan_stream("victim", limit=2), "probe": plan_stream("probe", limit=1)},
        (Phase("probe", 1.0, {"victim": 0.5, "probe": 0.5}),),
    )
    phase = workload.phases[0]
    got = []
    while (plan := workload.next_plan(phase)) is not None:
        got.append(plan.request_id)
        assert plan.phase == "probe"  # relabelled to the phase it is sent in
    assert sorted(got) == ["probe-0", "victim-0", "victim-1"]


# -- phases and budgets ----------------------------------------------------------------


async def test_phases_take_their_share_of_a_request_budget() -> None:
    events: list[Event] = []
    outcome = await make_runner(FakeSender(), events.append, budget=Budget(100)).run()
    assert outcome.reason == "completed"
    assert outcome.num_requests == outcome.num_observations == 100
    phases = [e.phase for e in events if isinstance(e, PhaseStarted)]
    assert phases == ["fill", "probe", "abort"]
    by_phase = Counter(p.phase for p in _plans(events))
    assert by_phase == {"fill": 15, "probe": 65, "abort": 20}
    fill = [p.intent for p in _plans(events) if p.phase == "fill"]
    assert set(fill) == {"victim"}
    probe = Counter(p.intent for p in _plans(events) if p.phase == "probe")
    assert probe["probe"] == pytest.approx(65 / 4, abs=1)
    abort = Counter(p.intent for p in _plans(events) if p.phase == "abort")
    assert abort["abort"] == 8
    assert isinstance(events[-1], RunFinished)
    assert events[-1].num_requests == 100
    # probes expected a rejection and got one; victims were accepted: no protocol finding
    assert outcome.findings == {}
    num_probes = sum(1 for p in _plans(events) if p.intent == "probe")
    assert outcome.errors == {"http_status": num_probes}


async def test_a_duration_budget_cycles_phases_by_time() -> None:
    events: list[Event] = []
    clock = SimClock()
    runner = make_runner(
        FakeSender(delay_s=0.01, clock=clock),
        events.append,
        budget=Budget(duration_s=0.6, cycle_s=0.3),
        clock=clock,
    )
    outcome = await runner.run()
    assert outcome.reason == "duration"
    phases = [e.phase for e in events if isinstance(e, PhaseStarted)]
    assert phases[:4] == ["fill", "probe", "abort", "fill"]
    assert outcome.num_requests == outcome.num_observations > 20


# -- pacing ----------------------------------------------------------------------------


async def test_closed_loop_keeps_exactly_n_requests_in_flight() -> None:
    sender = FakeSender(delay_s=0.01)
    await make_runner(sender, lambda e: None, pacing=ClosedLoop(3), budget=Budget(30)).run()
    assert sender.max_in_flight == 3
    assert len(sender.sent) == 30


def test_poisson_gaps_have_the_requested_mean() -> None:
    times = list(itertools.islice(PoissonArrivals(rate=50.0, seed=7).times(1_000), 5001))
    assert times[0] == 1_000
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) / 1e9 == pytest.approx(1 / 50, rel=0.05)


async def test_poisson_arrivals_follow_the_absolute_clock() -> None:
    """A stall delays the requests behind it, but never shifts their scheduled times."""
    stalled = False

    def stall_once(plan: RequestPlan) -> None:
        nonlocal stalled
        if not stalled and plan.request_id == "victim-5":
            stalled = True
            time.sleep(0.15)  # blocks the event loop, as a slow detector would

    sender = FakeSender(before=stall_once)
    pacing = PoissonArrivals(rate=200.0, seed=3)
    events: list[Event] = []
    await make_runner(sender, events.append, pacing=pacing, budget=Budget(60)).run()
    scheduled = [s for _, s, _ in sender.sent]
    offsets = list(itertools.islice(pacing.times(0), len(scheduled)))
    assert [s - scheduled[0] for s in scheduled] == offsets  # exactly the precomputed schedule
    queue_ms = [(sent - s) / 1e6 for _, s, sent in sender.sent]
    assert min(queue_ms) >= 0  # never early
    stall_at = [r for r, _, _ in sender.sent].index("victim-5")
    assert max(queue_ms[stall_at + 1 :]) > 50  # the slip shows up as queue time
    queue_by_request = {r: sent - s for r, s, sent in sender.sent}
    assert {o.request_id: o.queue_ns for o in _observations(events)} == queue_by_request


async def test_open_loop_respects_a_duration() -> None:
    clock = SimClock()
    sender = FakeSender(clock=clock)
    pacing = PoissonArrivals(rate=100.0, seed=1)
    outcome = await make_runner(
        sender, lambda e: None, pacing=pacing, budget=Budget(duration_s=0.3), clock=clock
    ).run()
    assert outcome.reason == "duration"
    assert 10 < outcome.num_requests < 60  # ~30 expected
    assert all(s - sender.sent[0][1] < 0.3e9 for _, s, _ in sender.sent)


# -- journal order ---------------------------------------------------------------------


class Body(httpx.AsyncByteStream):
    """A streamed response body (a plain `content=` body never reaches the client's meter)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def sse_reply(prompt_tokens: int, chunks: tuple[str, ...] = ("hello", " world")) -> httpx.Response:
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "text": c, "finish_reason": None}]} for c in chunks
    ]
    events.append({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(chunks)}
    events.append({"choices": [], "usage": usage})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=Body(body.encode())
    )


async def test_every_plan_is_journaled_and_indexed_before_it_is_sent(tmp_path: Path) -> None:
    journal_path = tmp_path / "journal.jsonl"
    journal = JournalWriter(journal_path)
    index = FakeIndex()
    checked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        records = [json.loads(line) for line in journal_path.read_text().splitlines()]
        planned = {r["request_id"]: r for r in records if r["type"] == "plan"}
        request_id = prompt.split()[-1]
        assert request_id in planned, f"{request_id} was sent before it was journaled"
        assert index.owners[f"<<{request_id}>>"] == (planned[request_id]["tenant"], request_id)
        checked.append(request_id)
        return sse_reply(100)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = TargetClient(http, "http://target.test", model="m")
        runner = make_runner(
            client,
            journal.write,
            index=index,
            budget=Budget(20),
            phases=(Phase("fill", 1.0, {"victim": 1.0}),),
        )
        outcome = await runner.run()
    journal.close()
    assert len(checked) == outcome.num_observations == 20
    events = list(read_journal(tmp_path))
    assert isinstance(events[-1], RunFinished)
    for plan in _plans(events):  # each plan precedes its observation
        kinds = [
            type(e).__name__
            for e in events
            if getattr(getattr(e, "plan", None), "request_id", None) == plan.request_id
            or getattr(getattr(e, "observation", None), "request_id", None) == plan.request_id
        ]
        assert kinds == ["PlanRecorded", "ObservationRecorded"]


async def test_content_findings_are_journaled_live_before_the_observation() -> None:
    events: list[Event] = []
    sender = FakeSender(chunks=("LEAK here", " more"))
    await make_runner(
        sender, events.append, budget=Budget(3), phases=(Phase("fill", 1.0, {"victim": 1.0}),)
    ).run()
    order = [
        (type(e).__name__, getattr(e, "finding", getattr(e, "observation", None)))
        for e in events
        if isinstance(e, FindingRecorded | ObservationRecorded)
    ]
    names = [name for name, _ in order]
    assert names == ["FindingRecorded", "ObservationRecorded"] * 3


async def test_a_target_that_fails_every_request_is_recorded_not_raised() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "internal error"}})

    events: list[Event] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = TargetClient(http, "http://target.test", model="m")
        outcome = await make_runner(client, events.append, budget=Budget(30)).run()
    assert outcome.reason == "completed"
    observations = _observations(events)
    assert len(observations) == len(_plans(events)) == 30
    assert {(o.status, o.error_kind) for o in observations} == {(500, "http_status")}
    assert outcome.errors == {"http_status": 30}
    assert outcome.findings == {}


# -- interruption ----------------------------------------------------------------------


async def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_stop_lets_requests_in_flight_finish_and_records_the_interruption() -> None:
    events: list[Event] = []
    runner = make_runner(FakeSender(delay_s=0.05), events.append, budget=Budget(10_000))
    task = asyncio.create_task(runner.run())
    await _wait_for(lambda: len(_observations(events)) >= 10)
    runner.stop()
    outcome = await task
    assert outcome.reason == "interrupted"
    observations = _observations(events)
    assert len(_plans(events)) == len(observations) < 100
    assert not [o for o in observations if o.error_kind == "cancelled"]
    assert isinstance(events[-1], RunFinished)
    assert events[-1].reason == "interrupted"
    assert events[-1].num_requests == len(observations)


async def test_requests_still_in_flight_after_the_grace_are_cancelled() -> None:
    events: list[Event] = []
    runner = make_runner(FakeSender(delay_s=60), events.append, grace_s=0.05)
    task = asyncio.create_task(runner.run())
    await _wait_for(lambda: len(_plans(events)) == 4)
    runner.stop()
    outcome = await asyncio.wait_for(task, timeout=5)
    assert outcome.reason == "interrupted"
    assert [o.error_kind for o in _observations(events)] == ["cancelled"] * 4
    assert isinstance(events[-1], RunFinished)


async def test_cancel_does_not_wait_for_the_grace() -> None:
    events: list[Event] = []
    runner = make_runner(FakeSender(delay_s=60), events.append, grace_s=60)
    task = asyncio.create_task(runner.run())
    await _wait_for(lambda: len(_plans(events)) == 4)
    runner.stop()
    runner.cancel()
    await asyncio.wait_for(task, timeout=5)
    assert len(_observations(events)) == 4


async def test_stop_interrupts_the_wait_for_the_next_arrival() -> None:
    events: list[Event] = []
    pacing = PoissonArrivals(rate=0.01, seed=0)  # the second arrival is minutes away
    runner = make_runner(FakeSender(), events.append, pacing=pacing)
    task = asyncio.create_task(runner.run())
    await _wait_for(lambda: len(_observations(events)) == 1)
    runner.stop()
    outcome = await asyncio.wait_for(task, timeout=5)
    assert outcome.reason == "interrupted"
    assert outcome.num_requests == 1


async def test_a_cancelled_run_loses_at_most_the_requests_in_flight(tmp_path: Path) -> None:
    journal = JournalWriter(tmp_path / "journal.jsonl")
    runner = make_runner(
        FakeSender(delay_s=0.02), journal.write, pacing=ClosedLoop(4), budget=Budget(10_000)
    )
    task = asyncio.create_task(runner.run())
    await _wait_for(lambda: journal.num_events > 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    journal.close()
    records = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    planned = [r["request_id"] for r in records if r["type"] == "plan"]
    answered = [
        r["request_id"]
        for r in records
        if r["type"] == "observation" and r["error_kind"] != "cancelled"
    ]
    assert set(answered) <= set(planned)
    assert len(planned) - len(answered) <= 4
    assert records[-1]["type"] == "run_finished"
    assert records[-1]["reason"] == "interrupted"


async def test_the_live_index_forgets_the_oldest_plans_when_full() -> None:
    index = FakeIndex(max_live=5)
    runner = make_runner(
        FakeSender(),
        lambda e: None,
        index=index,
        pacing=ClosedLoop(1),
        budget=Budget(20),
        phases=(Phase("fill", 1.0, {"victim": 1.0}),),
    )
    await runner.run()
    assert sorted(index.owners) == sorted(f"<<victim-{i}>>" for i in range(15, 20))
    assert index.discarded == [f"<<victim-{i}>>" for i in range(15)]
