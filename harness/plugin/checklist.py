"""The checklist: the nine items of the built-in suite, what each asks, which piece of
evidence it reads (`harness.plugin.checks` describes the evidence) and the decision that
answers it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcanary.harness.plugin.checks import (
    CheckOutcome,
    Evidence,
    no_leak_after_disconnect,
    no_leak_at_or_above_limits,
    no_leak_below_limits,
    no_shared_prefix_cache,
    over_context_rejected,
    over_pool_rejected,
    pool_holds_context,
    real_prefill,
    usage_matches,
)

if TYPE_CHECKING:
    from kvcanary.harness.plugin.target import WorkloadResult
    from kvcanary.harness.target.audit import AuditResult


@dataclass(frozen=True, slots=True)
class Check:
    """One item of the checklist: what it asks, which evidence it reads, how it decides."""

    number: int
    name: str
    title: str
    evidence: Evidence
    decide: Callable[..., CheckOutcome]

    def __call__(self, evidence: WorkloadResult | AuditResult) -> CheckOutcome:
        return self.decide(evidence)


CHECKS: tuple[Check, ...] = (
    Check(1, "over_pool_rejected", "over-pool prompts are rejected with an error, not answered",
          "incident", over_pool_rejected),
    Check(2, "over_context_rejected", "over-context prompts are rejected with an error",
          "incident", over_context_rejected),
    Check(3, "no_leak_at_or_above_limits",
          "no response at or above the limits contains another tenant's canary",
          "incident", no_leak_at_or_above_limits),
    Check(4, "no_leak_below_limits",
          "no response below the limits contains another tenant's canary under concurrent load",
          "below", no_leak_below_limits),
    Check(5, "usage_matches", "usage.prompt_tokens matches what was sent, at every size",
          "incident", usage_matches),
    Check(6, "real_prefill",
          "TTFT at the largest accepted size is consistent with a real prefill",
          "incident", real_prefill),
    Check(7, "no_leak_after_disconnect",
          "client disconnects mid-stream do not leak the aborted request's canaries into "
          "later responses", "incident", no_leak_after_disconnect),
    Check(8, "pool_holds_context", "the KV pool can hold the advertised context on every side",
          "audit", pool_holds_context),
    Check(9, "no_shared_prefix_cache",
          "no tenant is served from another tenant's prefix cache (opt-in timing probe)",
          "cache_probe", no_shared_prefix_cache),
)  # fmt: skip
CHECKS_BY_NAME: dict[str, Check] = {check.name: check for check in CHECKS}
