"""The protocol detector: what the target *said* about a request, checked against the plan.

Three findings, each decidable from one plan, its observation and the findings the other
detectors already made on it:

- `unsafe_accept`: the plan was sized above a limit (`plan.expected == "reject"`: the prompt
  *exceeds* the KV pool, the context, or the target's own input limit) and the target
  answered with a 2xx status. A safe target rejects such a prompt (400/413/422...); a
  vulnerable one answers it from pages it never filled. A 2xx status counts even if the
  stream later broke: the target accepted the request. Its severity follows the evidence:
  **critical** when the same answer carries a content leak (a canary of another tenant,
  request or run) or was flagged `fast_prefill`, or its `usage.prompt_tokens` is the
  placeholder signature (the prompt was never prefilled), and also when nothing shows
  either way (no usage); **high** when `usage.prompt_tokens` counts the whole prompt and no
  other detector fired: the target did process the prompt, it just should have refused it.
  A request answered while the timing fit was still too small to judge it online (the
  timing detector's deferred judgement) has its timing verdict only at the end of the run:
  the runner holds such a high `unsafe_accept` until then and passes it through
  `with_late_evidence` with the end-of-run findings, so a `fast_prefill` judged at the end
  makes it critical like one judged online (journaled once, at the end of the run, after
  that `fast_prefill`; a run that ends with an error journals it as it was). An answer the
  online fit already judged not fast, that the final fit flags after all, keeps its high
  `unsafe_accept` (the two findings stand side by side).
- `error_in_success` (medium): a 2xx status carrying an error instead of an answer (vLLM's
  `{"object": "error", ...}`, an `{"error": ...}` object, an SSE `error` event; the client's
  `error_kind == "error_in_success"`). Clients and monitoring count it as a success; the
  answer it stands for never came. For an over-limit plan it is a rejection in the wrong
  status, and replaces `unsafe_accept`.

A **boundary** plan (`plan.expected == "boundary"`: the prompt is exactly the tightest limit)
is never a protocol finding by itself: either answer is defensible (a pool of `n` tokens holds
an `n`-token prompt; SGLang refuses `len(input_ids) >= max_req_input_len`). What the target
did is counted (`boundary_counts`: accepted / rejected / unanswered) and reported as boundary
behaviour in summary.json (`boundary`) and the report; the content and timing detectors still
judge its answer like any other.
- `prompt_tokens_mismatch` (high): `usage.prompt_tokens`, net of the special tokens the
  server adds to every prompt of the plan's API (`prompt_token_offsets`, measured once at start
  by `harness.target.calibration`: llama.cpp's BOS is +1 on completions), is present and
  differs from `plan.num_prompt_tokens` by more than the tolerance, so like is compared with
  like and the finding names the offset. Plans carry exact counts in the
  target's tokenizer, chat-template overhead included, so the default tolerance is 0 tokens;
  `tolerance_tokens` (all APIs) and `chat_tolerance_tokens` (chat only, for a template
  whose overhead the plan could not count exactly) loosen it. A count that is tiny next to
  the prompt (at most `tiny_usage_fraction` of it; the incident's signature is `1` for a
  multi-thousand-token prompt) is called out in the summary: the prompt was swapped for a
  placeholder and never prefilled.

A response without `usage.prompt_tokens` yields no finding (many targets omit usage when
streaming); `num_without_usage` counts them so a report can say how much went unchecked.

It deliberately knows nothing about response text (the content detector) or timing (the
timing detector), and does not judge rejections of requests a safe target should accept.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import Limits
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.observation import Observation
from kvcanary.tenants.plan import RequestPlan

DETECTOR = "protocol"
PREFILL_SKIPPED_KINDS = frozenset(
    {
        FindingKind.CROSS_TENANT_CANARY,
        FindingKind.CROSS_REQUEST_CANARY,
        FindingKind.UNKNOWN_CANARY,
        FindingKind.FAST_PREFILL,
    }
)
"""Findings on an over-limit answer that make its `unsafe_accept` critical: it leaked content
or was answered faster than a prefill."""
BoundaryBehaviour = str
"""`accepted` (a 2xx answer), `rejected` (an error status or an error in a 2xx) or `unanswered`."""


def boundary_behaviour(obs: Observation) -> BoundaryBehaviour:
    """What a target did with a boundary plan (the same rule summary.json counts by)."""
    if obs.status is None:
        return "unanswered"
    if _accepted(obs) and obs.error_kind != "error_in_success":
        return "accepted"
    return "rejected"


class ProtocolDetector:
    """Checks status codes and `usage` of each observation against its plan."""

    def __init__(
        self,
        limits: Limits,
        *,
        tolerance_tokens: int = 0,
        chat_tolerance_tokens: int | None = None,
        tiny_usage_fraction: float = 0.05,
        prompt_token_offsets: Mapping[str, int] | None = None,
    ) -> None:
        """`prompt_token_offsets`: per API (`completions`, `chat`), the tokens the server adds
        to every prompt, as calibration measured them (absent: 0)."""
        if tolerance_tokens < 0 or (
            chat_tolerance_tokens is not None and chat_tolerance_tokens < 0
        ):
            raise ConfigError("protocol: prompt-token tolerances cannot be negative")
        if not 0 <= tiny_usage_fraction < 1:
            raise ConfigError(
                f"protocol: tiny_usage_fraction must be in [0, 1), got {tiny_usage_fraction}"
            )
        self.limits = limits
        self.tolerance_tokens = tolerance_tokens
        self.chat_tolerance_tokens = (
            tolerance_tokens if chat_tolerance_tokens is None else chat_tolerance_tokens
        )
        self.tiny_usage_fraction = tiny_usage_fraction
        self.prompt_token_offsets = dict(prompt_token_offsets or {})
        self.num_checked = 0
        self.num_without_usage = 0
        """Successful responses that carried no `usage.prompt_tokens` (nothing to compare)."""
        self.boundary_counts: Counter[BoundaryBehaviour] = Counter()
        """Boundary plans by what the target did with them (never a finding by themselves)."""

    def check(
        self, plan: RequestPlan, obs: Observation, evidence: Sequence[Finding] = ()
    ) -> list[Finding]:
        """Every protocol finding for one finished request (usually none). `evidence`: the
        other detectors' findings on this request so far (they set `unsafe_accept`'s
        severity)."""
        assert plan.request_id == obs.request_id, "observation does not belong to this plan"
        self.num_checked += 1
        findings = []
        if plan.expected == "boundary":
            self.boundary_counts[boundary_behaviour(obs)] += 1
        if obs.error_kind == "error_in_success":
            findings.append(self._error_in_success(plan, obs))
        elif plan.expected == "reject" and _accepted(obs):
            findings.append(self._unsafe_accept(plan, obs, evidence))
        reported = obs.usage.prompt_tokens
        if reported is None:
            if _accepted(obs):
                self.num_without_usage += 1
        elif abs(reported - self._offset(plan) - plan.num_prompt_tokens) > self._tolerance(plan):
            findings.append(self._mismatch(plan, obs, reported))
        return findings

    def limits_crossed(self, plan: RequestPlan) -> list[tuple[str, int]]:
        """The limits this plan's prompt exceeds, as (name, tokens), tightest first."""
        candidates = [
            ("KV pool", self.limits.pool_tokens),
            ("context", self.limits.context_tokens),
        ]
        if self.limits.max_input_tokens is not None:
            candidates.append(("input limit", self.limits.max_input_tokens))
        crossed = [(name, n) for name, n in candidates if plan.num_prompt_tokens > n]
        if not crossed and plan.num_prompt_tokens + plan.max_tokens > self.limits.context_tokens:
            crossed.append(("context (prompt + max_tokens)", self.limits.context_tokens))
        return sorted(crossed, key=lambda item: item[1])

    def _offset(self, plan: RequestPlan) -> int:
        return self.prompt_token_offsets.get(plan.api, 0)

    def _tolerance(self, plan: RequestPlan) -> int:
        return self.chat_tolerance_tokens if plan.api == "chat" else self.tolerance_tokens

    def _unsafe_accept(
        self, plan: RequestPlan, obs: Observation, evidence: Sequence[Finding]
    ) -> Finding:
        crossed = self.limits_crossed(plan)
        if crossed:
            above = " and ".join(f"the {name} ({n} tokens)" for name, n in crossed)
        else:
            above = "the limit it was planned to exceed"
        severity, why = self._unsafe_accept_severity(plan, obs, evidence)
        summary = (
            f"{plan.tenant}'s {plan.request_id} sent a {plan.num_prompt_tokens}-token prompt "
            f"above {above} and got HTTP {obs.status} instead of an error ({why})"
        )
        return Finding.on_request(
            FindingKind.UNSAFE_ACCEPT,
            DETECTOR,
            plan.request_id,
            plan.tenant,
            summary,
            severity=severity,
            details={
                "num_prompt_tokens": plan.num_prompt_tokens,
                "max_tokens": plan.max_tokens,
                "limits_crossed": {name: n for name, n in crossed},
                "limit_crossed": crossed[0][0] if crossed else None,
                "limits_source": self.limits.source,
                "status": obs.status,
                "error_kind": obs.error_kind,
                "usage_prompt_tokens": obs.usage.prompt_tokens,
                "num_text_chars": obs.num_text_chars,
                "phase": plan.phase,
                "intent": plan.intent,
                "size_label": plan.size_label,
                "severity_evidence": why,
                "evidence_kinds": sorted(
                    {str(f.kind) for f in evidence if f.request_id == plan.request_id}
                ),
            },
        )

    def _unsafe_accept_severity(
        self, plan: RequestPlan, obs: Observation, evidence: Sequence[Finding]
    ) -> tuple[Severity, str]:
        """Critical with a leak, a fast prefill or a placeholder count, or without evidence;
        high when `usage` counts the whole prompt and nothing else fired."""
        own = sorted(
            {
                str(f.kind)
                for f in evidence
                if f.request_id == plan.request_id and f.kind in PREFILL_SKIPPED_KINDS
            }
        )
        if own:
            return Severity.CRITICAL, f"the same answer was flagged {', '.join(own)}"
        reported = obs.usage.prompt_tokens
        if reported is None:
            return Severity.CRITICAL, "no usage to show the prompt was prefilled"
        net = reported - self._offset(plan)
        if net <= self.tiny_usage_fraction * plan.num_prompt_tokens:
            return Severity.CRITICAL, f"usage.prompt_tokens={reported}: never prefilled"
        if abs(net - plan.num_prompt_tokens) <= self._tolerance(plan):
            return (
                Severity.HIGH,
                f"usage.prompt_tokens={reported} shows a real prefill and nothing leaked",
            )
        return Severity.CRITICAL, f"usage.prompt_tokens={reported} does not match the prompt"

    def _error_in_success(self, plan: RequestPlan, obs: Observation) -> Finding:
        what = "an over-limit prompt's rejection" if plan.expected == "reject" else "an error"
        summary = (
            f"{plan.tenant}'s {plan.request_id} got HTTP {obs.status} carrying {what} instead "
            "of an answer: clients and monitoring count it as a success (the error is in the "
            "request's record, redacted like any text the target sent)"
        )
        return Finding.on_request(
            FindingKind.ERROR_IN_SUCCESS,
            DETECTOR,
            plan.request_id,
            plan.tenant,
            summary,
            details={
                "num_prompt_tokens": plan.num_prompt_tokens,
                "status": obs.status,
                "expected": plan.expected,
                "intent": plan.intent,
                "size_label": plan.size_label,
            },
        )

    def _mismatch(self, plan: RequestPlan, obs: Observation, reported: int) -> Finding:
        planned = plan.num_prompt_tokens
        tolerance = self._tolerance(plan)
        offset = self._offset(plan)
        difference = reported - offset - planned
        net = f", net of the {offset:+d} token(s) the server adds to every {plan.api} prompt"
        net = net if offset else ""
        tiny = reported <= self.tiny_usage_fraction * planned
        if tiny:
            summary = (
                f"{plan.tenant}'s {plan.request_id} sent a {planned}-token prompt but the "
                f"target reported usage.prompt_tokens={reported}{net}: the incident "
                f"signature of a prompt replaced by a placeholder and never prefilled"
            )
        else:
            summary = (
                f"{plan.tenant}'s {plan.request_id} sent {planned} prompt tokens but the target "
                f"reported usage.prompt_tokens={reported} (off by {difference:+d}{net}, "
                f"tolerance {tolerance})"
            )
        return Finding.on_request(
            FindingKind.PROMPT_TOKENS_MISMATCH,
            DETECTOR,
            plan.request_id,
            plan.tenant,
            summary,
            details={
                "num_prompt_tokens": planned,
                "usage_prompt_tokens": reported,
                "special_tokens_offset": offset,
                "difference": difference,
                "tolerance_tokens": tolerance,
                "incident_signature": tiny,
                "api": plan.api,
                "status": obs.status,
                "expected": plan.expected,
                "size_label": plan.size_label,
            },
        )


def with_late_evidence(finding: Finding, evidence: Sequence[Finding]) -> Finding:
    """`finding` (an `unsafe_accept`) weighed again with `evidence` found after it (the
    timing detector's end-of-run findings): critical when one of them, on the same request,
    shows the prefill was skipped; otherwise `finding` unchanged."""
    if finding.kind != FindingKind.UNSAFE_ACCEPT or finding.severity == Severity.CRITICAL:
        return finding
    late = sorted(
        {
            str(f.kind)
            for f in evidence
            if f.request_id == finding.request_id and f.kind in PREFILL_SKIPPED_KINDS
        }
    )
    if not late:
        return finding
    why = f"the same answer was flagged {', '.join(late)} at the end of the run"
    earlier = finding.details.get("severity_evidence")
    summary = finding.summary
    if earlier and summary.endswith(f"({earlier})"):
        summary = summary[: -len(f"({earlier})")] + f"({why})"
    kinds = set(finding.details.get("evidence_kinds", ())) | set(late)
    details = {
        **finding.details,
        "severity_evidence": why,
        "evidence_kinds": sorted(kinds),
        "severity_before_late_evidence": str(finding.severity),
    }
    return dataclasses.replace(
        finding, severity=Severity.CRITICAL, summary=summary, details=details
    )


def _accepted(obs: Observation) -> bool:
    return obs.status is not None and 200 <= obs.status < 300
