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
from kvcanary.tenants.planner import PlanDraw, Planner, PlanStream


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


Drawn = RequestPlan | PlanDraw
"""A plan a stream gave: built already, or drawn to be built with others (`PlanStream`)."""


class Workload:
    """The plans a run sends: one stream per intent, interleaved per phase.

    A stream that can draw plans without building them (`tenants.planner.PlanStream`) lets
    `next_plans` build many at once, in one batch per planner; any other iterator of plans
    is taken as it is."""

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
        plans = self.next_plans([phase])
        return plans[0] if plans else None

    def next_plans(self, phases: Sequence[Phase]) -> list[RequestPlan]:
        """One plan per phase given, in order (fewer when every stream ends)."""
        return self.build(self.draw(phases))

    def draw(self, phases: Sequence[Phase]) -> list[Drawn]:
        """The next plans of `phases` (one each) decided, by smooth weighted round robin;
        `build` makes them. Drawing is cheap: no prompt is built."""
        drawn: list[Drawn] = []
        for phase in phases:
            one = self._draw(phase)
            if one is None:
                break
            drawn.append(one)
        return drawn

    def builds_quickly(self, drawn: Sequence[Drawn]) -> bool:
        """Whether `build(drawn)` is short CPU work (`Planner.builds_quickly`)."""
        draws = [d for d in drawn if isinstance(d, PlanDraw)]
        return all(b.builds_quickly([d for d in draws if d.builder is b]) for b in _builders(draws))

    def build(self, drawn: Sequence[Drawn]) -> list[RequestPlan]:
        """The plans of `drawn`, in order; each planner's draws built in one batch."""
        draws = [d for d in drawn if isinstance(d, PlanDraw)]
        built: dict[int, RequestPlan] = {}
        for builder in _builders(draws):
            mine = [d for d in draws if d.builder is builder]
            built.update(zip(map(id, mine), builder.build(mine), strict=True))
        return [built[id(d)] if isinstance(d, PlanDraw) else d for d in drawn]

    def sketch(self, drawn: Sequence[Drawn]) -> list[RequestPlan]:
        """The plans of `drawn` without their prompts (`Planner.sketch`); built ones as
        they are."""
        return [d.builder.sketch(d) if isinstance(d, PlanDraw) else d for d in drawn]

    def _draw(self, phase: Phase) -> Drawn | None:
        while True:
            weights = {i: w for i, w in phase.weights.items() if w > 0 and i in self._streams}
            if not weights:
                return None
            credit = self._credit[phase.name]
            for intent, weight in weights.items():
                credit[intent] = credit.get(intent, 0.0) + weight
            intent = max(weights, key=lambda i: credit[i])
            credit[intent] -= sum(weights.values())
            stream = self._streams[intent]
            one: Drawn | None
            if isinstance(stream, PlanStream):
                one = stream.draw(phase.name)
            else:
                one = next(stream, None)
                if one is not None and one.phase != phase.name:
                    one = dataclasses.replace(one, phase=phase.name)
            if one is None:
                del self._streams[intent]  # an exhausted stream drops out of every mix
                continue
            return one


def _builders(draws: Sequence[PlanDraw]) -> list[Planner]:
    return list({id(d.builder): d.builder for d in draws}.values())
