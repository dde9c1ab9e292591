"""Target health: a target that stops serving mid-run is declared unhealthy, once, in the
journal and in the run's outcome; findings made before still stand."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator

from quiet_content import QuietContent

from kvcanary.canaries import Owner
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import (
    Event,
    HealthRouteFailed,
    Limits,
    ObservationRecorded,
    TargetServing,
    TargetUnhealthy,
    from_record,
    to_record,
)
from kvcanary.harness.record.observation import ErrorKind, Observation
from kvcanary.harness.run.arrivals import ClosedLoop
from kvcanary.harness.run.health import HealthTracker
from kvcanary.harness.run.runner import Budget, Detectors, Phase, Runner, Workload
from kvcanary.tenants.plan import Intent, RequestPlan
from kvcanary.tenants.tenant import Tenant

LIMITS = Limits(pool_tokens=1000, context_tokens=2000, page_size=16, source="flags")
TENANT = Tenant("tenant-0")


def obs(
    number: int,
    status: int | None,
    error_kind: ErrorKind | None = None,
    *,
    head: bool = True,
) -> Observation:
    return Observation(
        request_id=f"r{number}",
        tenant=TENANT.name,
        status=status,
        t_wall=1000.0 + number,
        t_scheduled_ns=0,
        t_sent_ns=0,
        t_first_byte_ns=1 if head and status is not None else None,
        error_kind=error_kind,
        error=None if error_kind is None else f"{error_kind} #{number}",
    )


def test_a_run_of_failures_after_successes_is_declared_once_and_the_recovery_counted() -> None:
    tracker = HealthTracker(threshold=3)
    assert tracker.observe(obs(0, 200), 1.0) == []
    assert tracker.observe(obs(1, 400, "http_status"), 2.0) == []  # a rejection is serving
    assert tracker.observe(obs(2, 503, "http_status"), 3.0) == []
    assert tracker.observe(obs(3, None, "connect"), 4.0) == []
    (declared,) = tracker.observe(obs(4, 500, "http_status"), 5.0)
    assert declared == TargetUnhealthy(
        t_wall=5.0,
        since_t_wall=1002.0,
        num_failed=3,
        num_served_before=2,
        first_request_id="r2",
        last_error="http_status #4",
    )
    assert tracker.observe(obs(5, 503, "http_status"), 6.0) == []  # declared once
    assert tracker.unhealthy
    assert tracker.observe(obs(6, 200), 7.0) == [TargetServing(t_wall=7.0, num_failed=4)]
    assert not tracker.unhealthy


def test_timeouts_aborts_and_failures_before_any_success_do_not_count() -> None:
    tracker = HealthTracker(threshold=2)
    for number in range(5):  # a target that never served is unreachable, not unhealthy
        assert tracker.observe(obs(number, None, "connect"), 1.0) == []
    tracker.observe(obs(10, 200), 1.0)
    for number, kind in enumerate(["timeout", "disconnected", "cancelled", "timeout"], 11):
        assert tracker.observe(obs(number, None, kind), 1.0) == [], kind  # type: ignore[arg-type]
    # a connection closed with no response head counts; one closed mid-body does not
    assert tracker.observe(obs(20, None, "protocol", head=False), 1.0) == []
    assert tracker.observe(obs(21, 200, "truncated"), 1.0) == []
    assert tracker.observe(obs(22, None, "protocol", head=False), 1.0) == []
    (declared,) = tracker.observe(obs(23, None, "protocol", head=False), 1.0)
    assert declared.first_request_id == "r22"


def test_health_events_survive_the_journal() -> None:
    declared = TargetUnhealthy(1.0, 0.5, 5, 12, "t0-r000013", "HTTP 503: CB worker is dead")
    for event in (declared, TargetServing(2.0, 7)):
        assert from_record(to_record(event)) == event


class DyingSender:
    """Serves `num_served` requests, then answers every one `503 CB worker is dead`."""

    def __init__(self, num_served: int) -> None:
        self.num_served = num_served
        self.count = itertools.count()

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: Callable[[str], None],
    ) -> Observation:
        alive = next(self.count) < self.num_served
        if alive:
            on_text("hello")
        return Observation(
            request_id=plan.request_id,
            tenant=plan.tenant,
            status=200 if alive else 503,
            t_wall=time.time(),
            t_scheduled_ns=t_scheduled_ns,
            t_sent_ns=time.perf_counter_ns(),
            t_first_byte_ns=time.perf_counter_ns(),
            t_first_token_ns=time.perf_counter_ns() if alive else None,
            t_done_ns=time.perf_counter_ns(),
            text="hello" if alive else "",
            finish_reason="stop" if alive else None,
            error_kind=None if alive else "http_status",
            error=None if alive else "HTTP 503: CB worker is dead",
        )


class _Index:
    max_live = 1 << 20

    def __init__(self) -> None:
        self.live: set[str] = set()

    def __len__(self) -> int:
        return len(self.live)

    def add_many(self, items: Iterable[tuple[str, Owner]]) -> None:
        self.live.update(text for text, _ in items)

    def discard(self, canary: str) -> None:
        self.live.discard(canary)


def victims() -> Iterator[RequestPlan]:
    for i in itertools.count():
        yield RequestPlan(
            request_id=f"t0-r{i:06d}",
            tenant=TENANT.name,
            phase="fill",
            intent="victim",
            size_label="fill",
            num_prompt_tokens=100,
            expected="accept",
            api="completions",
            prompt="text",
        )


async def test_a_target_whose_worker_dies_mid_run_is_declared_unhealthy() -> None:
    events: list[Event] = []
    streams: dict[Intent, Iterator[RequestPlan]] = {"victim": victims()}
    runner = Runner(
        sender=DyingSender(num_served=6),
        tenants={TENANT.name: TENANT},
        workload=Workload(streams, (Phase("fill", 1.0, {"victim": 1.0}),)),
        index=_Index(),
        detectors=Detectors(QuietContent(), ProtocolDetector(LIMITS), TimingDetector()),
        emit=events.append,
        pacing=ClosedLoop(1),
        budget=Budget(num_requests=20),
    )
    outcome = await runner.run()
    assert outcome.reason == "completed"
    declared = [e for e in events if isinstance(e, TargetUnhealthy)]
    assert len(declared) == 1
    assert outcome.target_unhealthy == declared[0]
    assert declared[0].num_served_before == 6
    assert declared[0].first_request_id == "t0-r000006"
    # the target's words are redacted (they may be another customer's), the status is not
    assert (declared[0].last_error or "").startswith("HTTP 503: [… 17 chars redacted, sha256:")
    # it is journaled right after the observation that tipped it
    before = events[events.index(declared[0]) - 1]
    assert isinstance(before, ObservationRecorded)
    assert before.observation.request_id == "t0-r000010"


def test_a_failing_health_route_is_recorded_once_and_declares_nothing_by_itself() -> None:
    """llama.cpp's /health stalls while its slots compute: a route failing while requests
    are answered is recorded, never a reason to call the target down."""
    tracker = HealthTracker(threshold=5)
    assert tracker.observe_health("GET /health: HTTP 503", 1.0, 1.0) == []  # not served yet
    assert tracker.observe_health("GET /health: HTTP 503", 2.0, 2.0) == []
    tracker.observe(obs(0, 200), 3.0)
    assert tracker.observe_health("GET /health: HTTP 503", 4.0, 4.1) == []  # one is a blip
    assert tracker.observe_health(None, 5.0, 5.1) == []
    assert tracker.observe_health("GET /health: no answer within 10 s", 6.0, 6.1) == []
    tracker.observe(obs(1, 200), 7.0)
    (recorded,) = tracker.observe_health("GET /health: no answer within 10 s", 8.0, 8.1)
    assert recorded == HealthRouteFailed(
        t_wall=8.1,
        since_t_wall=6.0,
        num_polls=2,
        last_error="GET /health: no answer within 10 s",
        num_served_since=1,
    )
    for t in (10.0, 12.0, 14.0):  # recorded once per run of failed polls
        assert tracker.observe_health("GET /health: HTTP 503", t, t + 0.1) == []
    for number in range(2, 12):  # requests keep being answered: nothing is declared
        assert tracker.observe(obs(number, 200), 15.0) == []
    assert not tracker.unhealthy
    assert tracker.declared is None
    assert from_record(to_record(recorded)) == recorded


def test_timeouts_while_the_health_route_fails_are_requests_that_stopped_completing() -> None:
    tracker = HealthTracker(threshold=3)
    tracker.observe(obs(0, 200), 1.0)
    assert tracker.observe(obs(1, None, "timeout"), 2.0) == []  # alone: a long prefill
    tracker.observe_health("GET /health: no answer within 10 s", 3.0, 3.1)
    assert tracker.observe(obs(2, None, "timeout"), 4.0) == []
    assert tracker.observe(obs(3, None, "timeout"), 5.0) == []
    (declared,) = tracker.observe(obs(4, 503, "http_status"), 6.0)
    assert (declared.source, declared.num_failed, declared.first_request_id) == ("health", 3, "r2")
    assert tracker.observe(obs(5, 200), 7.0) == [TargetServing(t_wall=7.0, num_failed=3)]
    # a passing poll: timeouts are neutral again
    tracker.observe_health(None, 8.0, 8.1)
    for number in range(6, 12):
        assert tracker.observe(obs(number, None, "timeout"), 9.0) == []
