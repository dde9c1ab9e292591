"""The plan feed: batches give the plans one-at-a-time taking gives; N workers keep N in
flight however plans are built."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_runner import TENANTS, FakeContent, FakeSender

from kvcanary.canaries import CanaryMinter, Tokenizer, load_tokenizer
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import Event, Limits, PhaseStarted, PlanRecorded
from kvcanary.harness.run import plan_feed
from kvcanary.harness.run.arrivals import ClosedLoop
from kvcanary.harness.run.runner import Budget, Detectors, Runner, Workload, default_phases
from kvcanary.tenants.plan import Intent, RequestPlan
from kvcanary.tenants.planner import Planner
from kvcanary.tenants.tenant import Tenant
from kvcanary.tenants.workload import get_profile

LIMITS = Limits(pool_tokens=600, context_tokens=900, page_size=16, source="flags")


@pytest.fixture(scope="module")
def cl100k() -> Tokenizer:
    return load_tokenizer("cl100k_base")


def planner(tokenizer: Tokenizer) -> Planner:
    tenants = [Tenant(name) for name in TENANTS]
    minter = CanaryMinter.from_seed(5, "run-feed")
    profile = get_profile("incident")
    return Planner(
        tenants, profile, tokenizer, minter, LIMITS, api="completions", page_size=16, seed=5
    )


def streams(source: Planner) -> dict[Intent, Iterator[RequestPlan]]:
    return {"victim": source.victims(), "probe": source.probes(), "abort": source.abort_plans()}


async def run(
    tokenizer: Tokenizer, num_requests: int, concurrency: int
) -> tuple[list[Event], FakeSender]:
    events: list[Event] = []
    sender = FakeSender(delay_s=0.01)
    source = planner(tokenizer)
    runner = Runner(
        sender=sender,
        tenants={t.name: t for t in source.tenants},
        workload=Workload(streams(source), default_phases(0.75)),
        index=source.index,
        detectors=Detectors(FakeContent(), ProtocolDetector(LIMITS), TimingDetector()),
        emit=events.append,
        pacing=ClosedLoop(concurrency),
        budget=Budget(num_requests=num_requests),
    )
    await runner.run()
    return events, sender


async def test_batched_plans_are_the_plans_taken_one_at_a_time(cl100k: Tokenizer) -> None:
    events, _ = await run(cl100k, 120, 16)
    planned = sorted((e.plan for e in events if isinstance(e, PlanRecorded)), key=_number)
    source = planner(cl100k)
    workload = Workload(streams(source), default_phases(0.75))
    one_by_one = [workload.next_plan(workload.phase_at(i / 120)) for i in range(120)]
    assert planned == one_by_one
    phases = [e.phase for e in events if isinstance(e, PhaseStarted)]
    assert phases == ["fill", "probe", "abort"]


async def test_n_workers_keep_n_requests_in_flight(
    cl100k: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_feed, "BATCH", 8)  # many batches while requests are in flight
    _, sender = await run(cl100k, 300, 64)
    assert sender.max_in_flight == 64


def _number(plan: RequestPlan) -> int:
    return int(plan.request_id.rsplit("r", 1)[1])
