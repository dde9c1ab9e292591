"""The runner's seams: what it needs from a sender, the detectors and the live canary index.

The runner talks to these through small protocols so that tests (and the cache probe, and
repro steps) can pass their own: a recorded target for the sender, a detector that defers
its end-of-run pass. The real ones are `harness.target.client.TargetClient`,
`harness.detectors.*` and `canaries.CanaryIndex`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvcanary.canaries import Hit, Owner
from kvcanary.harness.record.events import OwnEchoRecorded
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import ErrorKind, Observation, TextSink
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant


class Sender(Protocol):
    """Sends one plan and reports what was seen (`harness.target.client.TargetClient`)."""

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: TextSink,
    ) -> Observation: ...


@dataclass(frozen=True, slots=True)
class Executed:
    """One request built, sent and scanned elsewhere (`RemoteSender`), as the runner
    journals and judges it: what the content detector found, the observation as the journal
    keeps it (text redacted, secrets scrubbed, timestamps on the runner's clock), and the
    journal lines of the plan and the observation where they were encoded already."""

    plan: RequestPlan
    """The plan as the runner took it (a sketch, `Planner.sketch`), or as built here."""
    observation: Observation
    """As journaled, but its text: that is in `observation_line` (when given)."""
    streamed: tuple[Finding, ...] = ()
    """Content findings made while the response streamed."""
    content: tuple[Finding, ...] = ()
    """Content findings made at the end of the response."""
    echo: OwnEchoRecorded | None = None
    plan_line: bytes | None = None
    observation_line: bytes | None = None


@runtime_checkable
class RemoteSender(Protocol):
    """Builds, sends and scans plans elsewhere (`harness.run.ray_sender`, `--ray`): the
    runner draws them (`builds_plans`: as sketches, their prompts built elsewhere) and
    journals and judges what comes back."""

    @property
    def builds_plans(self) -> bool: ...

    async def execute(self, plan: RequestPlan, *, t_scheduled_ns: int) -> Executed:
        """`plan` sent at `t_scheduled_ns` (the runner's clock) and what it came to."""
        ...

    def built(self, plan: RequestPlan) -> RequestPlan:
        """`plan` with its prompt and canaries (a sketch is built here: it was cancelled)."""
        ...


class ResponseScan(Protocol):
    """The content detector's state for one response."""

    @property
    def hits(self) -> Sequence[Hit]: ...

    def feed(self, chunk: str, field: str = "content") -> list[Finding]:
        """One delta of the response field `field` (`harness.record.observation.TextSink`)."""
        ...

    def finish(self, obs: Observation) -> list[Finding]: ...

    def own_echo_event(self, t_wall: float) -> OwnEchoRecorded | None:
        """The request's own prompt quoted back in canary shape (journaled, not a finding)."""
        ...


class ContentScanner(Protocol):
    def start(self, plan: RequestPlan) -> ResponseScan: ...


class PlanChecker(Protocol):
    def check(
        self, plan: RequestPlan, obs: Observation, evidence: Sequence[Finding] = ()
    ) -> list[Finding]:
        """`evidence`: the other detectors' findings on this request (content, timing)."""
        ...


class TimingChecker(Protocol):
    def observe(self, plan: RequestPlan, obs: Observation) -> list[Finding]: ...

    def finish(self) -> list[Finding]: ...

    @property
    def model(self) -> TtftModel | None: ...

    @property
    def not_judged(self) -> str | None: ...


class CanaryRegistry(Protocol):
    """The live canary index (`canaries.CanaryIndex`)."""

    max_live: int

    def __len__(self) -> int: ...

    def add_many(self, items: Iterable[tuple[str, Owner]]) -> None: ...

    def discard(self, canary: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Detectors:
    """The three detectors every observation passes through."""

    content: ContentScanner
    protocol: PlanChecker
    timing: TimingChecker


def unanswered(
    plan: RequestPlan, t_scheduled_ns: int, t_done_ns: int, error_kind: ErrorKind, error: str
) -> Observation:
    """The observation of a request that got no answer: cancelled, or its sender lost."""
    return Observation(
        request_id=plan.request_id,
        tenant=plan.tenant,
        status=None,
        t_wall=time.time(),
        t_scheduled_ns=t_scheduled_ns,
        t_sent_ns=t_scheduled_ns,
        t_done_ns=t_done_ns,
        error_kind=error_kind,
        error=error,
    )
