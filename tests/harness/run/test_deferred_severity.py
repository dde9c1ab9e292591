"""An over-limit answer judged by timing only at the end of the run gets its `unsafe_accept`
severity from that judgement.

Early in a run the TTFT fit is too small to judge online, so the timing detector defers a
fast answer to the end. An over-limit probe answered then with a full `usage` count looks
like a real prefill (a high `unsafe_accept`) until the final fit shows it was not: the
runner holds that `unsafe_accept` until the end and journals it once, critical.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from quiet_content import QuietContent

from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.record.events import Event, FindingRecorded, Limits, RunFinished
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.observation import Observation, Usage
from kvcanary.harness.run.arrivals import ClosedLoop
from kvcanary.harness.run.runner import Budget, Detectors, Phase, Runner, Workload
from kvcanary.tenants.plan import Intent, RequestPlan
from kvcanary.tenants.tenant import Tenant

LIMITS = Limits(pool_tokens=1000, context_tokens=2000, page_size=16, source="flags")
TENANTS = {t.name: t for t in (Tenant("tenant-0"), Tenant("tenant-1"))}
PROBE_TOKENS = 1500
MS_PER_TOKEN = 0.5


def plans(intent: Intent) -> Iterator[RequestPlan]:
    for i in range(1000):
        probe = intent == "probe"
        yield RequestPlan(
            request_id=f"{intent}-{i}",
            tenant=f"tenant-{i % 2}",
            phase="unset",
            intent=intent,
            size_label="x",
            num_prompt_tokens=PROBE_TOKENS if probe else 100 + 100 * (i % 9),
            expected="reject" if probe else "accept",
            api="completions",
            prompt="",
        )


class AcceptsEverything:
    """A target that answers every prompt with 200 and a full usage count; victims take a
    real prefill's time, probes `probe_ttft_ms`; `fail_at` raises on that request."""

    def __init__(self, probe_ttft_ms: float, fail_at: str | None = None) -> None:
        self.probe_ttft_ms = probe_ttft_ms
        self.fail_at = fail_at
        self.t_ns = 1_000_000_000

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: Callable[[str], None],
    ) -> Observation:
        await asyncio.sleep(0)
        if plan.request_id == self.fail_at:
            raise RuntimeError("the sender broke")
        real = 20.0 + MS_PER_TOKEN * plan.num_prompt_tokens
        ttft_ms = self.probe_ttft_ms if plan.expected == "reject" else real
        sent = self.t_ns
        self.t_ns += 10_000_000_000
        first = sent + int(ttft_ms * 1e6)
        return Observation(
            request_id=plan.request_id,
            tenant=plan.tenant,
            status=200,
            t_wall=time.time(),
            t_scheduled_ns=t_scheduled_ns,
            t_sent_ns=sent,
            t_first_token_ns=first,
            t_done_ns=first + 1_000_000,
            text="fine",
            usage=Usage(prompt_tokens=plan.num_prompt_tokens, completion_tokens=1),
        )


def run(sender: AcceptsEverything, num_requests: int = 20) -> list[Event]:
    events: list[Event] = []
    phases = (Phase("fill", 0.5, {"victim": 1.0}), Phase("probe", 0.5, {"probe": 1.0}))
    runner = Runner(
        sender=sender,
        tenants=TENANTS,
        workload=Workload({"victim": plans("victim"), "probe": plans("probe")}, phases),
        index=FakeIndex(),
        detectors=Detectors(QuietContent(), ProtocolDetector(LIMITS), TimingDetector()),
        emit=events.append,
        pacing=ClosedLoop(1),
        budget=Budget(num_requests=num_requests),
    )
    if sender.fail_at is None:
        asyncio.run(runner.run())
    else:
        with pytest.raises(RuntimeError, match="the sender broke"):
            asyncio.run(runner.run())
    return events


class FakeIndex:
    max_live = 1 << 20

    def __len__(self) -> int:
        return 0

    def add_many(self, items: object) -> None:
        pass

    def discard(self, canary: str) -> None:
        pass


def findings(events: list[Event], kind: FindingKind) -> list[Finding]:
    return [e.finding for e in events if isinstance(e, FindingRecorded) and e.finding.kind == kind]


def test_a_fast_prefill_found_at_the_end_makes_the_unsafe_accept_critical() -> None:
    events = run(AcceptsEverything(probe_ttft_ms=5.0))  # a 1500-token prefill takes ~770 ms
    fast = findings(events, FindingKind.FAST_PREFILL)
    unsafe = findings(events, FindingKind.UNSAFE_ACCEPT)
    assert fast
    assert {f.details["evaluated"] for f in fast} == {"final"}  # 10 fit samples: deferred
    assert sorted(f.request_id or "" for f in unsafe) == sorted(f.request_id or "" for f in fast)
    for finding in unsafe:  # once per request, critical, with the evidence named
        assert finding.severity == Severity.CRITICAL
        assert "flagged fast_prefill at the end of the run" in finding.summary
        assert finding.details["severity_before_late_evidence"] == "high"
        assert finding.details["evidence_kinds"] == ["fast_prefill"]
    kinds = [e.finding.kind for e in events if isinstance(e, FindingRecorded)]
    assert kinds.index(FindingKind.FAST_PREFILL) < kinds.index(FindingKind.UNSAFE_ACCEPT)
    assert isinstance(events[-1], RunFinished)


def test_a_real_prefill_judged_at_the_end_keeps_its_unsafe_accept_high() -> None:
    events = run(AcceptsEverything(probe_ttft_ms=20.0 + MS_PER_TOKEN * PROBE_TOKENS))
    assert findings(events, FindingKind.FAST_PREFILL) == []
    unsafe = findings(events, FindingKind.UNSAFE_ACCEPT)
    assert len(unsafe) == 10  # every probe, once, journaled at the end
    assert {f.severity for f in unsafe} == {Severity.HIGH}
    assert all("shows a real prefill" in f.summary for f in unsafe)


def test_a_run_that_fails_still_journals_the_held_unsafe_accepts() -> None:
    events = run(AcceptsEverything(probe_ttft_ms=5.0, fail_at="probe-3"))
    unsafe = findings(events, FindingKind.UNSAFE_ACCEPT)
    assert [f.request_id for f in unsafe] == ["probe-0", "probe-1", "probe-2"]
    assert {f.severity for f in unsafe} == {Severity.HIGH}  # no end-of-run timing pass
    assert isinstance(events[-1], RunFinished)
    assert events[-1].reason == "error"
