"""What a run costs: requests, prompt tokens and completion tokens, and their price.

`PlanTotals` adds up what plans ask for, counted the way a paid endpoint can bill them at
most: every prompt token of every plan (a prompt a safe target must reject is still
counted, since a vulnerable one accepts it) and every plan's `max_tokens` as completion
tokens. `CostBudget` is what the user allows (`--max-requests`, `--max-prompt-tokens`,
`--price-per-mtok IN,OUT --max-cost AMOUNT`); `excess` names each limit a total breaks,
with the figures, and `SpendMeter` admits plans one at a time until the budget is spent
(how a soak, whose length is a duration, stops on its budget).

It knows nothing about transport, pacing or phases: the harness decides which plans a run
will send (`harness.run.cost_guard`), this module only counts them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.tenants.plan import RequestPlan

MTOK = 1_000_000


@dataclass(frozen=True, slots=True)
class Prices:
    """Price per million tokens, of prompt (input) and of completion (output) tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def cost(self, num_prompt_tokens: int, num_completion_tokens: int) -> float:
        return (
            num_prompt_tokens * self.input_per_mtok + num_completion_tokens * self.output_per_mtok
        ) / MTOK


@dataclass(slots=True)
class PlanTotals:
    """Requests and tokens that plans ask for (see the module docstring for how)."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0

    def add(self, plan: RequestPlan) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += plan.num_prompt_tokens
        self.num_completion_tokens += plan.max_tokens

    def with_plan(self, plan: RequestPlan) -> PlanTotals:
        """These totals with `plan` added (these stay as they are)."""
        totals = dataclasses.replace(self)
        totals.add(plan)
        return totals

    def describe(self, prices: Prices | None) -> str:
        """`12 requests, 1,234 prompt tokens, 768 completion tokens (cost 0.0052)`."""
        text = (
            f"{self.num_requests:,} requests, {self.num_prompt_tokens:,} prompt tokens, "
            f"{self.num_completion_tokens:,} completion tokens"
        )
        if prices is not None:
            text += f" (cost {self.cost(prices):.4g})"
        return text

    def cost(self, prices: Prices) -> float:
        return prices.cost(self.num_prompt_tokens, self.num_completion_tokens)

    def to_dict(self, prices: Prices | None) -> dict[str, Any]:
        record: dict[str, Any] = dataclasses.asdict(self)
        record["cost"] = round(self.cost(prices), 6) if prices is not None else None
        return record


@dataclass(frozen=True, slots=True)
class CostBudget:
    """The most a run may send; a limit left None is not checked."""

    max_requests: int | None = None
    max_prompt_tokens: int | None = None
    max_cost: float | None = None
    prices: Prices | None = None

    def __post_init__(self) -> None:
        if self.max_cost is not None and self.prices is None:
            raise ConfigError("--max-cost needs --price-per-mtok IN,OUT to price the tokens")

    @property
    def active(self) -> bool:
        """Whether any limit is set (prices alone only price the run)."""
        limits = (self.max_requests, self.max_prompt_tokens, self.max_cost)
        return any(limit is not None for limit in limits)

    def excess(self, totals: PlanTotals) -> list[str]:
        """Each limit `totals` break, with both figures; empty when they fit."""
        broken = []
        if self.max_requests is not None and totals.num_requests > self.max_requests:
            broken.append(
                f"{totals.num_requests:,} requests > --max-requests {self.max_requests:,}"
            )
        if self.max_prompt_tokens is not None and totals.num_prompt_tokens > self.max_prompt_tokens:
            broken.append(
                f"{totals.num_prompt_tokens:,} prompt tokens > --max-prompt-tokens "
                f"{self.max_prompt_tokens:,}"
            )
        if self.max_cost is not None and self.prices is not None:
            cost = totals.cost(self.prices)
            if cost > self.max_cost:
                broken.append(f"cost {cost:.4g} > --max-cost {self.max_cost:g}")
        return broken

    def to_dict(self) -> dict[str, Any]:
        prices = self.prices
        return {
            "max_requests": self.max_requests,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_cost": self.max_cost,
            "price_per_mtok": None
            if prices is None
            else [prices.input_per_mtok, prices.output_per_mtok],
        }


class SpendMeter:
    """Admits plans while they fit the budget; the first that does not ends the spending."""

    def __init__(self, budget: CostBudget) -> None:
        self.budget = budget
        self.spent = PlanTotals()
        self.exhausted = False

    def admit(self, plan: RequestPlan) -> bool:
        """Count `plan` and say yes, or say no (and from then on always no)."""
        if self.exhausted:
            return False
        after = self.spent.with_plan(plan)
        if self.budget.excess(after):
            self.exhausted = True
            return False
        self.spent = after
        return True
