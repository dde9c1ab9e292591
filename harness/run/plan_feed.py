"""The runner's supply of plans: the next plan to send, in its phase, within the budget.

Where a run stands in its budget (requests taken, or time spent: `position`) picks the phase;
the workload's smooth weighted round robin picks each plan's intent. Plans are drawn a batch
at a time (`BATCH` plans, or `BATCH_TOKENS` tokens) and built together
(`Workload.build`: their canaries minted in one pass): on the event loop when that is short
CPU work (a local tokenizer, short prompts), else in a worker thread, where a long prompt
does not stall the streams in flight (nor skew their timestamps) and a tokenizer that is a
server reached through this loop can answer. So taking a plan is usually a `popleft`, and a
closed loop of N workers keeps N requests in flight whatever a prompt costs to build.

With a request budget the phases of a batch are those of the requests it holds, so the plans
are those one-at-a-time taking gives; with a duration the batch is drawn in the phase of the
moment, and a plan taken after the phase changed is relabelled with the new phase. Plans
drawn but never sent (the run stopped, the cost guard said no) are dropped unjournaled.

With `sketch` (`--ray`, where the actors build the prompts) plans are only drawn: each is a
sketch (`Planner.sketch`: everything but its prompt and canaries), which is cheap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable

from kvcanary.harness.record.events import Event, PhaseStarted
from kvcanary.harness.run.arrivals import Clock
from kvcanary.harness.run.phases import Budget, Drawn, Phase, Workload
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.planner import QUICK_BUILD_TOKENS, PlanDraw

BATCH = 32
"""Plans drawn and built at a time, at most: the cipher's and numpy's fixed costs are paid
once per batch; few enough that a stop wastes little."""
BATCH_TOKENS = QUICK_BUILD_TOKENS // 4
"""A batch stops growing once its prompts hold this many tokens, so one of short prompts
always builds on the event loop (`Planner.builds_quickly`); a long prompt is a batch alone."""


class PlanFeed:
    """Plans for the runner, a batch ahead; `take` is the one entry point."""

    def __init__(
        self,
        workload: Workload,
        budget: Budget,
        clock: Clock,
        *,
        emit: Callable[[Event], None],
        elapsed_before_s: float = 0.0,
        admit: Callable[[RequestPlan], bool] | None = None,
        sketch: bool = False,
    ) -> None:
        self._workload, self._budget, self._clock = workload, budget, clock
        self._emit = emit
        self._elapsed_before_s = elapsed_before_s
        self._admit = admit
        """The cost guard's meter: no to a plan ends the run (`refused` is then set)."""
        self._sketch = sketch
        self._ready: deque[RequestPlan] = deque()
        self._lock = asyncio.Lock()
        self._phase: Phase | None = None
        self.t0_ns = 0
        self.num_taken = 0
        self.refused = False

    async def take(self, t_ns: int | None, stopping: asyncio.Event) -> RequestPlan | None:
        """The next plan to send at `t_ns` (default: now), or None when the budget is spent,
        the streams ended, the run is stopping or the cost guard refused this plan."""
        async with self._lock:  # taken at once unless a batch is being built in a thread
            if stopping.is_set():
                return None
            fraction = self.position(self._clock.now_ns() if t_ns is None else t_ns)
            if fraction is None:
                return None
            phase = self._workload.phase_at(fraction)
            if phase is not self._phase:
                self._phase = phase
                self._emit(PhaseStarted(phase.name, t_wall=time.time()))
            if not self._ready:
                await self._refill(phase)
                if not self._ready or stopping.is_set():
                    return None
            plan = self._ready.popleft()
            if plan.phase != phase.name:  # drawn before a timed phase change
                plan = dataclasses.replace(plan, phase=phase.name)
            if self._admit is not None and not self._admit(plan):
                self.refused = True  # requests in flight finish; nothing more is sent
                return None
            self.num_taken += 1
            return plan

    def position(self, t_ns: int) -> float | None:
        """Where `t_ns` is in the budget (or its cycle), in [0, 1); None when it is spent."""
        budget = self._budget
        if budget.num_requests is not None:
            if self.num_taken >= budget.num_requests:
                return None
            return self.num_taken / budget.num_requests
        assert budget.duration_s is not None
        elapsed_s = self._elapsed_before_s + (t_ns - self.t0_ns) / 1e9
        if elapsed_s >= budget.duration_s:
            return None
        cycle_s = min(budget.cycle_s or budget.duration_s, budget.duration_s)
        return (elapsed_s % cycle_s) / cycle_s

    async def _refill(self, phase: Phase) -> None:
        workload, num_requests = self._workload, self._budget.num_requests
        drawn: list[Drawn] = []
        num_tokens = 0
        while len(drawn) < BATCH and num_tokens < BATCH_TOKENS:
            if num_requests is not None:
                if self.num_taken + len(drawn) >= num_requests:
                    break
                phase = workload.phase_at((self.num_taken + len(drawn)) / num_requests)
            one = workload.draw([phase])
            if not one:
                break
            drawn += one
            num_tokens += _num_tokens(one[0])
        if self._sketch:
            self._ready.extend(workload.sketch(drawn))
        elif workload.builds_quickly(drawn):
            self._ready.extend(workload.build(drawn))
        else:
            self._ready.extend(await asyncio.to_thread(workload.build, drawn))


def _num_tokens(drawn: Drawn) -> int:
    return drawn.spec.num_tokens if isinstance(drawn, PlanDraw) else drawn.num_prompt_tokens
