"""Factories for synthetic plans and observations shared by the detector tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcanary.harness.record.events import Limits
from kvcanary.harness.record.observation import Observation, Usage
from kvcanary.tenants.plan import RequestPlan

LIMITS = Limits(pool_tokens=2048, context_tokens=4096, page_size=16, source="flags")

PlanFactory = Callable[..., RequestPlan]
ObsFactory = Callable[..., Observation]


def make_plan(
    request_id: str = "t0-r000001",
    *,
    tenant: str = "tenant-0",
    num_prompt_tokens: int = 1000,
    expected: str = "accept",
    api: str = "completions",
    **overrides: Any,
) -> RequestPlan:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "tenant": tenant,
        "phase": "fill",
        "intent": "victim" if expected == "accept" else "probe",
        "size_label": "over_pool" if expected == "reject" else "fill",
        "num_prompt_tokens": num_prompt_tokens,
        "expected": expected,
        "api": api,
        "prompt": "",
        "max_tokens": 16,
    }
    fields.update(overrides)
    return RequestPlan(**fields)


def make_obs(
    plan: RequestPlan,
    *,
    status: int | None = 200,
    ttft_ms: float | None = 50.0,
    prompt_tokens: int | None = -1,
    text: str = "",
    error_kind: str | None = None,
) -> Observation:
    """An observation of `plan`; prompt_tokens=-1 means 'usage as planned'."""
    sent = 1_000_000_000
    first = None if ttft_ms is None else sent + int(ttft_ms * 1e6)
    usage_tokens = plan.num_prompt_tokens if prompt_tokens == -1 else prompt_tokens
    return Observation(
        request_id=plan.request_id,
        tenant=plan.tenant,
        status=status,
        t_wall=1.7e9,
        t_scheduled_ns=sent,
        t_sent_ns=sent,
        t_first_byte_ns=first,
        t_first_token_ns=first,
        t_done_ns=None if first is None else first + 10_000_000,
        text=text,
        num_text_chars=len(text),
        usage=Usage(prompt_tokens=usage_tokens, completion_tokens=4),
        finish_reason="length",
        error_kind=error_kind,  # type: ignore[arg-type]
    )
