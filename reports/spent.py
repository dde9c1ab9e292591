"""`summary.json`'s `spent`: what a run sent, as the cost guard counts it, beside what the
target reported (`tenants.cost`: every planned prompt token, completions at `max_tokens`)."""

from __future__ import annotations

from typing import Any

from kvcanary.reports.frames import RunFrames
from kvcanary.tenants.cost import PlanTotals, Prices


def spent(frames: RunFrames) -> dict[str, Any]:
    """What the run sent, counted as the cost guard counts (`tenants.cost`: every planned
    prompt token, completions at their `max_tokens`), beside what the target reported."""
    requests = frames.requests
    planned = PlanTotals(
        num_requests=len(requests),
        num_prompt_tokens=int(requests["num_prompt_tokens"].sum()),
        num_completion_tokens=int(requests["max_tokens"].sum()),
    )
    settings = frames.run.settings if frames.run is not None else {}
    prices = settings.get("price_per_mtok")
    priced = Prices(*prices) if isinstance(prices, list | tuple) and len(prices) == 2 else None
    reported_prompt = int(requests["prompt_tokens"].sum())
    reported_completion = int(requests["completion_tokens"].sum())
    return {
        **planned.to_dict(priced),
        "num_prompt_tokens_reported": reported_prompt,
        "num_completion_tokens_reported": reported_completion,
        "cost_reported": round(priced.cost(reported_prompt, reported_completion), 6)
        if priced is not None
        else None,
        "budget": {
            name: settings.get(name)
            for name in ("max_requests", "max_prompt_tokens", "max_cost", "price_per_mtok")
        },
    }
