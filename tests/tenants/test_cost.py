"""The cost guard's counting: totals of plans, the limits they break, the meter a soak spends."""

from __future__ import annotations

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.run.option_values import parse_prices
from kvcanary.tenants.cost import CostBudget, PlanTotals, Prices, SpendMeter
from kvcanary.tenants.plan import RequestPlan


def plan(num_prompt_tokens: int, max_tokens: int = 10) -> RequestPlan:
    return RequestPlan(
        request_id="t0-r000000",
        tenant="tenant-0",
        phase="fill",
        intent="victim",
        size_label="x",
        num_prompt_tokens=num_prompt_tokens,
        expected="accept",
        api="completions",
        prompt="",
        max_tokens=max_tokens,
    )


def test_totals_count_every_prompt_token_and_every_answer_at_its_max_tokens() -> None:
    totals = PlanTotals()
    totals.add(plan(1000, 16))
    totals.add(plan(3000, 64))
    assert (totals.num_requests, totals.num_prompt_tokens, totals.num_completion_tokens) == (
        2,
        4000,
        80,
    )
    prices = Prices(input_per_mtok=2.0, output_per_mtok=10.0)
    assert totals.cost(prices) == pytest.approx((4000 * 2.0 + 80 * 10.0) / 1e6)
    assert totals.to_dict(prices)["cost"] == pytest.approx(0.0088)
    assert totals.describe(None) == "2 requests, 4,000 prompt tokens, 80 completion tokens"


def test_excess_names_each_broken_limit_with_both_figures() -> None:
    totals = PlanTotals(num_requests=60, num_prompt_tokens=2_000_000, num_completion_tokens=0)
    budget = CostBudget(
        max_requests=50, max_prompt_tokens=1_000_000, max_cost=1.0, prices=Prices(1.0, 0.0)
    )
    assert budget.excess(totals) == [
        "60 requests > --max-requests 50",
        "2,000,000 prompt tokens > --max-prompt-tokens 1,000,000",
        "cost 2 > --max-cost 1",
    ]
    assert CostBudget(max_requests=60, max_prompt_tokens=2_000_000).excess(totals) == []
    assert not CostBudget(prices=Prices(1.0, 1.0)).active


def test_a_cost_limit_needs_prices() -> None:
    with pytest.raises(ConfigError, match="--max-cost needs --price-per-mtok"):
        CostBudget(max_cost=5.0)


def test_the_meter_refuses_the_first_plan_that_would_break_the_budget_and_every_later_one() -> None:
    meter = SpendMeter(CostBudget(max_prompt_tokens=250))
    assert [meter.admit(plan(100)), meter.admit(plan(100))] == [True, True]
    assert not meter.admit(plan(100))  # 300 > 250
    assert not meter.admit(plan(10))  # it would fit, but the budget is spent: no more
    assert meter.spent.num_prompt_tokens == 200
    assert meter.exhausted


@pytest.mark.parametrize("text", ["1", "1,2,3", "a,b", "-1,2", "nan,1", ""])
def test_prices_are_two_non_negative_numbers(text: str) -> None:
    with pytest.raises(ValueError, match="IN,OUT"):
        parse_prices(text)
    assert parse_prices("0.15,0.6") == (0.15, 0.6)
