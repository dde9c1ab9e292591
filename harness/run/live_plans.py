"""The plans whose canaries are live in the run's index, oldest first.

Before a plan is sent its canaries join the live index, owned by its tenant and request; when
the index is full (`max_live`, which `CanaryIndex.keep_live` sets to what the target's KV
memory can still hold), the oldest plans' canaries are forgotten first. A forgotten canary
is still attributed through the run key when it is found whole; only its fragments go
undetected, and only for plans thousands of requests old.
"""

from __future__ import annotations

from collections import deque

from kvcanary.canaries import Owner
from kvcanary.harness.run.seams import CanaryRegistry
from kvcanary.tenants.plan import RequestPlan


class LivePlans:
    """Registers each plan's canaries in `index`, forgetting the oldest plans' when full."""

    def __init__(self, index: CanaryRegistry) -> None:
        self._index = index
        self._plans: deque[tuple[str, ...]] = deque()
        """Canary texts per plan in the index, oldest first."""

    def register(self, plan: RequestPlan) -> None:
        texts = tuple(canary.text for canary in plan.canaries)
        index = self._index
        while self._plans and len(index) + len(texts) > index.max_live:
            for text in self._plans.popleft():
                index.discard(text)
        owner = Owner(plan.tenant, plan.request_id)
        index.add_many((text, owner) for text in texts)
        self._plans.append(texts)
