"""What a run sends and for how long: phases with intent weights, a budget, and the
workload that interleaves the planner's streams by smooth weighted round robin.

    fill    victims only: canary-laced prompts a safe target accepts fill its KV pool
    probe   probes at and above the limits, interleaved with continuing victim traffic
    abort   abort plans mixed with victims and probes (the release path under load)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvcanary.tenants.plan import Intent, RequestPlan


@dataclass(frozen=True, slots=True)
class Phase:
    """One stage of a run: its share of the budget and the relative weights of its intents."""

    name: str
    share: float
    weights: Mapping[Intent, float]

    def __post_init__(self) -> None:
        assert 0 < self.share <= 1, f"phase {self.name}: share must be in (0, 1]"
        assert self.weights, f"phase {self.name} sends nothing"
        assert all(w >= 0 for w in self.weights.values()), "intent weights cannot be negative"


def default_phases(victim_fraction: float) -> tuple[Phase, ...]:
    """fill / probe / abort, with victims making up `victim_fraction` of mixed traffic."""
    probe_fraction = 1.0 - victim_fraction
    return (
        Phase("fill", 0.15, {"victim": 1.0}),
        Phase("probe", 0.65, {"victim": victim_fraction, "probe": probe_fraction}),
        Phase(
            "abort",
            0.20,
            {"abort": 0.4, "victim": 0.6 * victim_fraction, "probe": 0.6 * probe_fraction},
        ),
    )


@dataclass(frozen=True, slots=True)
class Budget:
    """When a run ends: after `num_requests` sent, or after `duration_s` seconds.

    Phases take their shares of the whole budget, or, with `cycle_s`, of each cycle of that
    many seconds (soaks repeat fill / probe / abort for hours).
    """

    num_requests: int | None = None
    duration_s: float | None = None
    cycle_s: float | None = None

    def __post_init__(self) -> None:
        assert (self.num_requests is None) != (self.duration_s is None), (
            "a budget is a request count or a duration"
        )
        assert self.cycle_s is None or self.duration_s is not None


class Workload:
    """The plans a run sends: one stream per intent, interleaved per phase."""

    def __init__(
        self, streams: Mapping[Intent, Iterator[RequestPlan]], phases: Sequence[Phase]
    ) -> None:
        assert phases, "a workload needs at least one phase"
        self._streams = dict(streams)
        self.phases = tuple(phases)
        self._bounds: list[float] = []
        total = sum(phase.share for phase in self.phases)
        running = 0.0
        for phase in self.phases:
            running += phase.share / total
            self._bounds.append(running)
        self._credit: dict[str, dict[Intent, float]] = {p.name: {} for p in self.phases}

    def phase_at(self, fraction: float) -> Phase:
        """The phase for a position in [0, 1) of the budget (or of a cycle)."""
        for phase, bound in zip(self.phases, self._bounds, strict=True):
            if fraction < bound:
                return phase
        return self.phases[-1]

    def next_plan(self, phase: Phase) -> RequestPlan | None:
        """The phase's next plan by smooth weighted round robin; None when all streams end."""
        while True:
            weights = {i: w for i, w in phase.weights.items() if w > 0 and i in self._streams}
            if not weights:
                return None
            credit = self._credit[phase.name]
            for intent, weight in weights.items():
                credit[intent] = credit.get(intent, 0.0) + weight
            intent = max(weights, key=lambda i: credit[i])
            credit[intent] -= sum(weights.values())
            plan = next(self._streams[intent], None)
            if plan is None:
                del self._streams[intent]  # an exhausted stream drops out of every mix
                continue
            if plan.phase != phase.name:
                plan = dataclasses.replace(plan, phase=phase.name)
            return plan
