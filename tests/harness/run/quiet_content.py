"""A content detector that finds nothing: for runner tests about everything but content."""

from __future__ import annotations

from kvcanary.canaries import Hit
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import Observation
from kvcanary.tenants.plan import RequestPlan


class QuietScan:
    def __init__(self) -> None:
        self.hits: list[Hit] = []

    def feed(self, chunk: str, field: str = "content") -> list[Finding]:
        return []

    def own_echo_event(self, t_wall: float) -> None:
        return None

    def finish(self, obs: Observation) -> list[Finding]:
        return []


class QuietContent:
    def start(self, plan: RequestPlan) -> QuietScan:
        return QuietScan()
