"""The cost guard: what a run will send, totalled before anything is sent, refused if too much.

`plan_totals` replays the runner's choice of plans for a request-bounded run (the phase
schedule over the request count, smooth weighted round robin within a phase, the planner's
streams in their order) on prompt-less sketches (`tenants.planner.sketch_streams`), so its
totals are those of the very plans the run will send, known before a tokenizer, a key or a
request. A duration-bound run (a soak) has no total in advance: its budget is spent as it
goes, and the runner stops cleanly before the first plan that would break it.

`guard` is the one decision: refuse (`ConfigError`, exit 2, with the figures) a plan over
budget unless `--yes`; otherwise hand the runner a `SpendMeter`, so that even a run let past
with `--yes` never sends more than its budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.phases import Phase, Workload
from kvcanary.tenants.cost import PlanTotals, SpendMeter
from kvcanary.tenants.plan import ApiStyle
from kvcanary.tenants.planner import sketch_streams
from kvcanary.tenants.size import LimitsLike
from kvcanary.tenants.workload import WorkloadProfile


def plan_totals(
    profile: WorkloadProfile,
    limits: LimitsLike,
    api: ApiStyle,
    *,
    num_requests: int,
    phases: Sequence[Phase],
) -> PlanTotals:
    """Requests and tokens of the first `num_requests` plans the runner will take."""
    workload = Workload(sketch_streams(profile, limits, api), phases)
    totals = PlanTotals()
    for num_taken in range(num_requests):  # the runner's position: requests taken so far
        plan = workload.next_plan(workload.phase_at(num_taken / num_requests))
        if plan is None:
            break
        totals.add(plan)
    return totals


def guard(
    config: RunConfig,
    profile: WorkloadProfile,
    limits: LimitsLike,
    phases: Sequence[Phase],
    note: Callable[[str], None],
) -> SpendMeter | None:
    """Refuse a request-bounded run whose plan is over budget (unless `--yes`); the meter
    the runner spends against, or None when no limit was given."""
    budget = config.cost_budget
    if config.num_requests is None:
        if budget.active:
            note("cost guard: a duration-bound run stops cleanly when its budget is spent")
        return SpendMeter(budget) if budget.active else None
    totals = plan_totals(
        profile, limits, config.api, num_requests=config.num_requests, phases=phases
    )
    if budget.active or budget.prices is not None:
        note(f"plan: {totals.describe(budget.prices)}")
    broken = budget.excess(totals)
    if broken and not config.yes:
        raise ConfigError(
            f"the plan exceeds the cost guard: {'; '.join(broken)} "
            f"(plan: {totals.describe(budget.prices)}); nothing was sent. Raise the limits, "
            "or pass --yes to run until the budget is spent"
        )
    if broken:
        note(f"cost guard: over budget ({'; '.join(broken)}); --yes: stopping when it is spent")
    return SpendMeter(budget) if budget.active else None
