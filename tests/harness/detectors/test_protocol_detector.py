"""The protocol detector on synthetic plans and observations."""

from __future__ import annotations

import pytest
from detector_factories import LIMITS, make_obs, make_plan

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.detectors import ProtocolDetector
from kvcanary.harness.detectors.protocol import with_late_evidence
from kvcanary.harness.record.events import Limits
from kvcanary.harness.record.finding import Finding, FindingKind, Severity


def kinds(findings: list) -> list[FindingKind]:  # type: ignore[type-arg]
    return [f.kind for f in findings]


def test_rejection_of_an_over_limit_prompt_is_fine() -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="reject")
    obs = make_obs(plan, status=400, ttft_ms=None, prompt_tokens=None, error_kind="http_status")
    assert ProtocolDetector(LIMITS).check(plan, obs) == []


def test_success_for_an_over_limit_prompt_is_unsafe_accept() -> None:
    plan = make_plan("t1-r000004", tenant="tenant-1", num_prompt_tokens=3000, expected="reject")
    [finding] = ProtocolDetector(LIMITS).check(plan, make_obs(plan, status=200))
    assert finding.kind is FindingKind.UNSAFE_ACCEPT
    assert finding.severity is Severity.HIGH  # usage counts the whole prompt, nothing leaked
    assert (finding.request_id, finding.tenant, finding.detector) == (
        "t1-r000004",
        "tenant-1",
        "protocol",
    )
    assert finding.details["num_prompt_tokens"] == 3000
    assert finding.details["limit_crossed"] == "KV pool"
    assert finding.details["limits_crossed"] == {"KV pool": 2048}
    assert finding.details["status"] == 200
    assert "3000-token prompt above the KV pool (2048 tokens)" in finding.summary
    assert "HTTP 200" in finding.summary


def test_unsafe_accept_names_every_limit_crossed_tightest_first() -> None:
    limits = Limits(2048, 4096, 16, "flags", max_input_tokens=4000)
    plan = make_plan(num_prompt_tokens=5000, expected="reject")
    [finding] = ProtocolDetector(limits).check(plan, make_obs(plan, status=200))
    assert list(finding.details["limits_crossed"]) == ["KV pool", "input limit", "context"]


def test_a_broken_stream_after_a_200_is_still_an_accept() -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="reject")
    obs = make_obs(plan, status=200, prompt_tokens=None, error_kind="truncated")
    assert kinds(ProtocolDetector(LIMITS).check(plan, obs)) == [FindingKind.UNSAFE_ACCEPT]


def test_transport_failure_without_status_is_not_an_accept() -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="reject")
    obs = make_obs(plan, status=None, ttft_ms=None, prompt_tokens=None, error_kind="timeout")
    assert ProtocolDetector(LIMITS).check(plan, obs) == []


def test_usage_of_one_for_a_huge_prompt_is_the_incident_signature() -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="reject")
    findings = ProtocolDetector(LIMITS).check(plan, make_obs(plan, status=200, prompt_tokens=1))
    assert kinds(findings) == [FindingKind.UNSAFE_ACCEPT, FindingKind.PROMPT_TOKENS_MISMATCH]
    mismatch = findings[1]
    assert mismatch.severity is Severity.HIGH
    assert mismatch.details["usage_prompt_tokens"] == 1
    assert mismatch.details["difference"] == -2999
    assert mismatch.details["incident_signature"] is True
    assert "usage.prompt_tokens=1" in mismatch.summary
    assert "placeholder" in mismatch.summary


def test_small_mismatch_is_reported_without_the_incident_wording() -> None:
    plan = make_plan(num_prompt_tokens=1000)
    [finding] = ProtocolDetector(LIMITS).check(plan, make_obs(plan, prompt_tokens=1003))
    assert finding.kind is FindingKind.PROMPT_TOKENS_MISMATCH
    assert finding.details["incident_signature"] is False
    assert "off by +3" in finding.summary
    assert "placeholder" not in finding.summary


def test_matching_usage_and_missing_usage_give_no_finding() -> None:
    detector = ProtocolDetector(LIMITS)
    plan = make_plan(num_prompt_tokens=1000)
    assert detector.check(plan, make_obs(plan)) == []
    assert detector.check(plan, make_obs(plan, prompt_tokens=None)) == []
    assert detector.num_without_usage == 1
    assert detector.num_checked == 2


def test_tolerance_applies_per_api() -> None:
    detector = ProtocolDetector(LIMITS, tolerance_tokens=0, chat_tolerance_tokens=8)
    chat = make_plan(num_prompt_tokens=1000, api="chat")
    completions = make_plan(num_prompt_tokens=1000, api="completions")
    assert detector.check(chat, make_obs(chat, prompt_tokens=1008)) == []
    assert kinds(detector.check(chat, make_obs(chat, prompt_tokens=1009))) == [
        FindingKind.PROMPT_TOKENS_MISMATCH
    ]
    assert kinds(detector.check(completions, make_obs(completions, prompt_tokens=1001))) == [
        FindingKind.PROMPT_TOKENS_MISMATCH
    ]


def test_a_planned_accept_never_gives_unsafe_accept() -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="accept")
    assert ProtocolDetector(LIMITS).check(plan, make_obs(plan, status=200)) == []


def test_negative_tolerance_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        ProtocolDetector(LIMITS, tolerance_tokens=-1)


def test_a_calibrated_offset_is_compared_like_with_like_per_api() -> None:
    detector = ProtocolDetector(LIMITS, prompt_token_offsets={"completions": 1})
    bos = make_plan(num_prompt_tokens=1000)
    assert detector.check(bos, make_obs(bos, prompt_tokens=1001)) == []
    chat = make_plan("t0-r000002", num_prompt_tokens=1000, api="chat")
    assert detector.check(chat, make_obs(chat, prompt_tokens=1000)) == []  # no chat offset
    [finding] = detector.check(bos, make_obs(bos, prompt_tokens=1000))
    assert finding.details["special_tokens_offset"] == 1
    assert finding.details["difference"] == -1
    assert "off by -1, net of the +1 token(s) the server adds to every completions prompt" in (
        finding.summary
    )


def test_an_offset_does_not_hide_the_incident_signature() -> None:
    detector = ProtocolDetector(LIMITS, prompt_token_offsets={"completions": 1})
    plan = make_plan(num_prompt_tokens=3000)
    [finding] = detector.check(plan, make_obs(plan, prompt_tokens=1))
    assert finding.kind is FindingKind.PROMPT_TOKENS_MISMATCH
    assert finding.details["incident_signature"] is True
    assert finding.details["difference"] == -3000
    assert "+1 token(s) the server adds" in finding.summary


def other_finding(kind: FindingKind, request_id: str) -> Finding:
    return Finding(kind, kind.severity, "content", request_id, "tenant-0", "an earlier finding")


@pytest.mark.parametrize(
    ("evidence", "prompt_tokens", "severity"),
    [
        ((), -1, Severity.HIGH),  # a real prefill shown by usage, nothing else fired
        ((FindingKind.CROSS_TENANT_CANARY,), -1, Severity.CRITICAL),
        ((FindingKind.UNKNOWN_CANARY,), -1, Severity.CRITICAL),
        ((FindingKind.FAST_PREFILL,), -1, Severity.CRITICAL),
        ((), 1, Severity.CRITICAL),  # the placeholder signature: never prefilled
        ((), None, Severity.CRITICAL),  # no usage: nothing shows a prefill
        ((), 2000, Severity.CRITICAL),  # usage that is not the prompt's
    ],
)
def test_unsafe_accept_severity_follows_the_evidence(
    evidence: tuple[FindingKind, ...], prompt_tokens: int | None, severity: Severity
) -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="reject")
    obs = make_obs(plan, status=200, prompt_tokens=prompt_tokens)
    others = [other_finding(kind, plan.request_id) for kind in evidence]
    others.append(other_finding(FindingKind.CROSS_TENANT_CANARY, "another-request"))
    found = ProtocolDetector(LIMITS).check(plan, obs, others)
    [accept] = [f for f in found if f.kind is FindingKind.UNSAFE_ACCEPT]
    assert accept.severity is severity
    assert accept.details["evidence_kinds"] == sorted(str(kind) for kind in evidence)


@pytest.mark.parametrize(
    ("status", "error_kind", "behaviour"),
    [
        (200, None, "accepted"),
        (200, "truncated", "accepted"),
        (400, "http_status", "rejected"),
        (200, "error_in_success", "rejected"),
        (None, "timeout", "unanswered"),
    ],
)
def test_a_prompt_exactly_at_the_limit_is_a_boundary_probe_never_a_finding(
    status: int | None, error_kind: str | None, behaviour: str
) -> None:
    plan = make_plan(num_prompt_tokens=LIMITS.pool_tokens, expected="boundary")
    obs = make_obs(plan, status=status, error_kind=error_kind)
    detector = ProtocolDetector(LIMITS)
    found = detector.check(plan, obs)
    assert FindingKind.UNSAFE_ACCEPT not in kinds(found)
    assert detector.boundary_counts == {behaviour: 1}


def test_one_token_over_the_limit_is_over_it() -> None:
    plan = make_plan(num_prompt_tokens=LIMITS.pool_tokens + 1, expected="reject")
    found = ProtocolDetector(LIMITS).check(plan, make_obs(plan, status=200))
    assert kinds(found) == [FindingKind.UNSAFE_ACCEPT]


@pytest.mark.parametrize("expected", ["accept", "boundary", "reject"])
def test_an_error_inside_a_success_status_is_its_own_finding(expected: str) -> None:
    plan = make_plan(num_prompt_tokens=3000 if expected == "reject" else 500, expected=expected)
    obs = make_obs(plan, status=200, prompt_tokens=None, error_kind="error_in_success")
    [finding] = ProtocolDetector(LIMITS).check(plan, obs)
    assert finding.kind is FindingKind.ERROR_IN_SUCCESS  # for reject: not an unsafe_accept
    assert finding.severity is Severity.MEDIUM
    assert "HTTP 200" in finding.summary


def test_a_fast_prefill_found_at_the_end_makes_a_high_unsafe_accept_critical() -> None:
    plan = make_plan(num_prompt_tokens=3000, expected="reject")
    [accept] = ProtocolDetector(LIMITS).check(plan, make_obs(plan, status=200))
    assert accept.severity is Severity.HIGH
    assert accept.summary.endswith(
        "(usage.prompt_tokens=3000 shows a real prefill and nothing leaked)"
    )
    # another request's fast prefill, or a finding that says nothing of the prefill: no change
    unrelated = [
        other_finding(FindingKind.FAST_PREFILL, "another-request"),
        other_finding(FindingKind.PROMPT_TOKENS_MISMATCH, plan.request_id),
    ]
    assert with_late_evidence(accept, unrelated) is accept
    late = [*unrelated, other_finding(FindingKind.FAST_PREFILL, plan.request_id)]
    upgraded = with_late_evidence(accept, late)
    assert upgraded.severity is Severity.CRITICAL
    assert upgraded.summary.endswith(
        "(the same answer was flagged fast_prefill at the end of the run)"
    )
    assert upgraded.summary.startswith(accept.summary.split(" (")[0])
    assert upgraded.details["evidence_kinds"] == ["fast_prefill"]
    assert upgraded.details["severity_before_late_evidence"] == "high"
    assert (upgraded.kind, upgraded.request_id) == (accept.kind, accept.request_id)
    # a critical unsafe_accept, or another kind, is left as it is
    assert with_late_evidence(upgraded, late) is upgraded
    mismatch = other_finding(FindingKind.PROMPT_TOKENS_MISMATCH, plan.request_id)
    assert with_late_evidence(mismatch, late) is mismatch
