"""The plans whose canaries are live in the run's index, oldest first.

Before a plan is sent its canaries join the live index, owned by its tenant and request; when
the index is full (`max_live`, which `CanaryIndex.keep_live` sets to what the target's KV
memory can still hold), the oldest plans' canaries are forgotten first. A forgotten canary
is still attributed through the run key when it is found whole; only its fragments go
undetected, and only for plans thousands of requests old.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

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
        self._make_room(len(texts))
        owner = Owner(plan.tenant, plan.request_id)
        self._index.add_many((text, owner) for text in texts)
        self._plans.append(texts)

    def keep_foreign(self, canaries: Sequence[tuple[str, Owner]]) -> None:
        """Canaries live in another index of the run and not yet here (`canaries.elsewhere`:
        a `--ray` run's other actors), kept as one more plan's, so they are forgotten in turn."""
        self._make_room(len(canaries))
        self._index.add_many(canaries)
        self._plans.append(tuple(text for text, _ in canaries))

    def _make_room(self, num_canaries: int) -> None:
        index = self._index
        while self._plans and len(index) + num_canaries > index.max_live:
            for text in self._plans.popleft():
                index.discard(text)
