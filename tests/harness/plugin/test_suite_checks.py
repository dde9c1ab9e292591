"""The built-in checks' decisions, on small journals written here (no target, no pytester).

Each journal goes through the same path as a real run's: `JournalWriter`, then
`read_result`, which reads it back with `reports.frames`, so the checks see exactly the
tables a run produces.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcanary.harness.detectors.timing import TimingDetector
from kvcanary.harness.plugin.checklist import CHECKS_BY_NAME
from kvcanary.harness.plugin.checks import (
    no_leak_after_disconnect,
    no_leak_at_or_above_limits,
    no_leak_below_limits,
    over_context_rejected,
    over_pool_rejected,
    pool_holds_context,
    real_prefill,
    usage_matches,
)
from kvcanary.harness.plugin.results import MAX_FINDINGS_SHOWN, describe
from kvcanary.harness.plugin.target import WorkloadResult, read_result
from kvcanary.harness.record.events import (
    Event,
    FindingRecorded,
    Limits,
    ObservationRecorded,
    PlanRecorded,
    RunFinished,
    RunStarted,
    TimingFitted,
)
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.journal import JournalWriter
from kvcanary.harness.record.observation import ErrorKind, Observation, Usage
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.target.audit import audit_facts
from kvcanary.harness.target.server_info import EngineFacts, Role, SideFacts
from kvcanary.tenants.plan import Expected, Intent, RequestPlan

POOL, CONTEXT = 2656, 4096
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass
class Req:
    """One request of a synthetic run: its plan and what the target did with it."""

    request_id: str
    tokens: int
    expected: Expected = "accept"
    intent: Intent = "victim"
    status: int | None = 200
    prompt_tokens: int | None = None
    ttft_ms: float | None = 100.0
    error_kind: ErrorKind | None = None


def write_run(tmp_path: Path, requests: list[Req], findings: list[Finding]) -> WorkloadResult:
    limits = Limits(POOL, CONTEXT, 16, "flags")
    events: list[Event] = [
        RunStarted("run", "http://target", "m", "completions", limits, (), 1, "k", t_wall=1.0)
    ]
    timing = TimingDetector()
    for r in requests:
        plan = RequestPlan(
            request_id=r.request_id,
            tenant=f"tenant-{r.request_id[1]}",
            phase="probe",
            intent=r.intent,
            size_label=str(r.tokens),
            num_prompt_tokens=r.tokens,
            expected=r.expected,
            api="completions",
            prompt="",
        )
        sent = 1_000_000
        first = None if r.ttft_ms is None else sent + round(r.ttft_ms * 1e6)
        usage = Usage(prompt_tokens=r.prompt_tokens if r.prompt_tokens else None)
        if r.status == 200 and r.prompt_tokens is None and r.error_kind is None:
            usage = Usage(prompt_tokens=r.tokens)
        observation = Observation(
            request_id=r.request_id,
            tenant=plan.tenant,
            status=r.status,
            t_wall=time.time(),
            t_scheduled_ns=sent,
            t_sent_ns=sent,
            t_first_token_ns=first if r.status == 200 else None,
            t_done_ns=sent + 10**9,
            usage=usage,
            error_kind=r.error_kind or ("http_status" if r.status and r.status >= 400 else None),
        )
        events += [PlanRecorded(plan), ObservationRecorded(observation)]
        timing.observe(plan, observation)
    events += [FindingRecorded(f, t_wall=2.0) for f in findings]
    # the runner journals the timing detector's final fit; checks apply exactly that line
    timing.finish()
    model = timing.model.to_dict() if timing.model is not None else None
    events.append(TimingFitted(model, t_wall=2.5, final=True, not_judged=timing.not_judged))
    events.append(RunFinished("completed", 3.0, len(requests)))
    writer = JournalWriter(tmp_path / "journal.jsonl")
    for event in events:
        writer.write(event)
    writer.close()
    return read_result(tmp_path, label="test", verdict=Verdict.INCONCLUSIVE, ended="completed")


def finding(kind: FindingKind, request_id: str, **extra: Any) -> Finding:
    return Finding(
        kind=kind,
        severity=Severity.CRITICAL,
        detector="test",
        request_id=request_id,
        tenant=f"tenant-{request_id[1]}",
        summary=f"{kind} in {request_id}",
        **extra,
    )


def leak(request_id: str, victim_request_id: str) -> Finding:
    return finding(
        FindingKind.CROSS_TENANT_CANARY,
        request_id,
        victim_tenant=f"tenant-{victim_request_id[1]}",
        victim_request_id=victim_request_id,
        excerpt="[… 3 chars redacted …]ydk one two three four five six",
    )


# -- 1 and 2: over-limit prompts are rejected ----------------------------------------------


def test_an_answered_over_pool_prompt_fails_check_1_with_its_finding(tmp_path: Path) -> None:
    accepted = finding(FindingKind.UNSAFE_ACCEPT, "t1-r1")
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000), Req("t1-r1", POOL + 1, "reject", "probe", prompt_tokens=1)],
        [accepted],
    )
    outcome = over_pool_rejected(run)
    assert outcome.status == "failed"
    assert outcome.findings == (accepted,)
    assert "1 of 1 prompt(s) above the KV pool (2656 tokens) got HTTP 200" in outcome.reason


def test_a_prompt_exactly_at_the_pool_is_a_boundary_probe_not_held_to_check_1(
    tmp_path: Path,
) -> None:
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000), Req("t1-r1", POOL, "boundary", "probe"),
         Req("t2-r2", POOL + 1, "reject", "probe", status=400)],
        [],
    )  # fmt: skip
    outcome = over_pool_rejected(run)
    assert outcome.status == "passed"
    assert outcome.reason == "all 1 prompt(s) above the KV pool (2656 tokens) were rejected"


def test_an_error_inside_a_200_is_a_refusal_for_check_1(tmp_path: Path) -> None:
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000),
         Req("t1-r1", POOL + 1, "reject", "probe", ttft_ms=None, error_kind="error_in_success")],
        [],
    )  # fmt: skip
    assert over_pool_rejected(run).status == "passed"


def test_rejected_over_limit_prompts_pass_checks_1_and_2(tmp_path: Path) -> None:
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000), Req("t1-r1", POOL + 1, "reject", "probe", status=400),
         Req("t2-r2", CONTEXT + 1, "reject", "probe", status=413)],
        [],
    )  # fmt: skip
    assert over_pool_rejected(run).status == "passed"
    assert over_context_rejected(run).status == "passed"


def test_over_limit_prompts_never_sent_or_never_answered_are_inconclusive(tmp_path: Path) -> None:
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000),
         Req("t1-r1", POOL + 1, "reject", "probe", status=None, ttft_ms=None,
             error_kind="timeout")],
        [],
    )  # fmt: skip
    pool, context = over_pool_rejected(run), over_context_rejected(run)
    assert pool.status == context.status == "failed"
    assert pool.reason.startswith("inconclusive: none of the 1 prompt(s)")
    assert "timeout 1" in pool.reason
    assert context.reason.startswith("inconclusive: no prompt above the context length")


# -- 3 and 4: no other tenant's canary -------------------------------------------------------


def test_a_leak_into_an_over_limit_answer_fails_check_3_not_check_4(tmp_path: Path) -> None:
    found = leak("t1-r1", "t0-r0")
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000), Req("t1-r1", POOL + 1, "reject", "probe", prompt_tokens=1)],
        [found],
    )
    outcome = no_leak_at_or_above_limits(run)
    assert outcome.status == "failed"
    assert outcome.findings == (found,)
    assert "responses to tenant-1; canaries of tenant-0" in outcome.reason
    assert no_leak_below_limits(run).status == "passed"


def test_an_unknown_canary_alone_does_not_fail_the_leak_checks(tmp_path: Path) -> None:
    unknown = finding(FindingKind.UNKNOWN_CANARY, "t1-r1")
    run = write_run(tmp_path, [Req("t0-r0", 1000), Req("t1-r1", 900)], [unknown])
    assert no_leak_below_limits(run).status == "passed"


def test_a_leak_below_the_limits_fails_check_4(tmp_path: Path) -> None:
    run = write_run(tmp_path, [Req("t0-r0", 1000), Req("t1-r1", 900)], [leak("t1-r1", "t0-r0")])
    outcome = no_leak_below_limits(run)
    assert outcome.status == "failed"
    assert outcome.findings[0].victim_request_id == "t0-r0"


# -- 5: usage ----------------------------------------------------------------------------------


def test_a_placeholder_usage_count_fails_check_5_naming_the_sizes(tmp_path: Path) -> None:
    mismatch = finding(FindingKind.PROMPT_TOKENS_MISMATCH, "t1-r1")
    run = write_run(tmp_path, [Req("t0-r0", 1000), Req("t1-r1", 2650, prompt_tokens=1)], [mismatch])
    outcome = usage_matches(run)
    assert outcome.status == "failed"
    assert "in 1 of 2 answer(s): 2650 sent -> 1" in outcome.reason


def test_a_target_without_usage_skips_check_5(tmp_path: Path) -> None:
    run = write_run(tmp_path, [Req("t0-r0", 1000, status=400, ttft_ms=None)], [])
    outcome = usage_matches(run)
    assert outcome.status == "skipped"
    assert "no usage.prompt_tokens" in outcome.reason


# -- 6: TTFT -----------------------------------------------------------------------------------


def linear_ttfts(noise_ms: float) -> list[Req]:
    """Twenty answers whose TTFT grows 0.5 ms per token, plus seeded Gaussian noise."""
    rng = random.Random(0)
    sizes = [400 + 180 * i for i in range(20)]
    return [
        Req(f"t{i % 4}-r{i}", n, ttft_ms=2000 + 0.5 * n + rng.gauss(0, noise_ms))
        for i, n in enumerate(sizes)
    ]


def test_a_clean_prefill_line_passes_check_6(tmp_path: Path) -> None:
    outcome = real_prefill(write_run(tmp_path, linear_ttfts(noise_ms=2.0), []))
    assert outcome.status == "passed"
    assert outcome.reason.startswith("the largest accepted prompt (3820 tokens, t3-r19) got")


def test_ttft_noise_larger_than_a_prefill_skips_check_6(tmp_path: Path) -> None:
    outcome = real_prefill(write_run(tmp_path, linear_ttfts(noise_ms=900.0), []))
    assert outcome.status == "skipped"
    assert outcome.reason.startswith("not judged: TTFT noise")
    assert "hides the prefill of every answered prompt" in outcome.reason


def test_over_limit_answers_too_short_to_judge_skip_check_6_as_not_judged(
    tmp_path: Path,
) -> None:
    # a clean line, but the answered over-pool probe is shorter than the rule's reach
    requests = [*linear_ttfts(noise_ms=100.0), Req("t1-r98", POOL + 1, "reject", "probe")]
    run = write_run(tmp_path, requests, [])
    model = run.summary["timing"]["model"]
    assert model["min_eligible_tokens"] > POOL + 1  # the premise: too short for the rule
    outcome = real_prefill(run)
    assert outcome.status == "skipped"
    assert outcome.reason.startswith("not judged: 1 of 1 answered over-limit prompt(s)")


def test_a_largest_prompt_answered_too_fast_fails_check_6_without_a_finding(
    tmp_path: Path,
) -> None:
    # below the detector's flagging margin, but far under the fitted line at that size
    requests = [*linear_ttfts(noise_ms=40.0), Req("t1-r99", 5000, ttft_ms=2100.0)]
    outcome = real_prefill(write_run(tmp_path, requests, []))
    assert outcome.status == "failed"
    assert outcome.reason.startswith("the largest accepted prompt (5000 tokens, t1-r99) got")
    assert outcome.reason.endswith("it was not prefilled")
    text = describe(CHECKS_BY_NAME["real_prefill"], outcome)
    assert "  - t1-r99: 5000 tokens (5000, expected accept), HTTP 200, " in text


def test_a_fast_prefill_finding_fails_check_6(tmp_path: Path) -> None:
    requests = linear_ttfts(noise_ms=2.0)
    fast = finding(FindingKind.FAST_PREFILL, requests[-1].request_id)
    outcome = real_prefill(write_run(tmp_path, requests, [fast]))
    assert outcome.status == "failed"
    assert outcome.findings == (fast,)


# -- 7: disconnects ----------------------------------------------------------------------------


def abort_run(tmp_path: Path, findings: list[Finding], **later: Any) -> WorkloadResult:
    return write_run(
        tmp_path,
        [Req("t0-r0", 1000, intent="abort", status=200, error_kind="disconnected"),
         Req("t1-r1", 900, **later)],
        findings,
    )  # fmt: skip


def test_an_aborted_requests_canary_in_an_honest_later_answer_fails_check_7(
    tmp_path: Path,
) -> None:
    found = leak("t1-r1", "t0-r0")
    outcome = no_leak_after_disconnect(abort_run(tmp_path, [found]))
    assert outcome.status == "failed"
    assert outcome.findings == (found,)


def test_a_placeholder_answer_quoting_an_aborted_request_is_not_a_disconnect_leak(
    tmp_path: Path,
) -> None:
    # the answer was never prefilled (usage 1): stale pages, which checks 3 and 5 report
    findings = [leak("t1-r1", "t0-r0"), finding(FindingKind.PROMPT_TOKENS_MISMATCH, "t1-r1")]
    outcome = no_leak_after_disconnect(abort_run(tmp_path, findings, prompt_tokens=1))
    assert outcome.status == "passed"


def test_a_run_without_disconnects_is_inconclusive_for_check_7(tmp_path: Path) -> None:
    outcome = no_leak_after_disconnect(write_run(tmp_path, [Req("t0-r0", 1000)], []))
    assert outcome.status == "failed"
    assert outcome.reason.startswith("inconclusive: no request was disconnected")


# -- 8: the audit ------------------------------------------------------------------------------


def facts(*pools: int | None) -> EngineFacts:
    sides = tuple(
        SideFacts(role, f"http://target#{role}", pool, None, CONTEXT, 16)
        for role, pool in zip(ROLES, pools, strict=False)
    )
    return EngineFacts("sglang-pd", "http://target", sides, CONTEXT, 16, ())


@pytest.mark.parametrize(
    ("pools", "status"),
    [((POOL, 8192), "failed"), ((8192, 8192), "passed"), ((None, 8192), "skipped")],
)
def test_check_8_reads_the_audit(pools: tuple[int | None, ...], status: str) -> None:
    outcome = pool_holds_context(audit_facts(facts(*pools)))
    assert outcome.status == status
    if status == "failed":
        assert outcome.findings[0].kind is FindingKind.POOL_SMALLER_THAN_CONTEXT


# -- how a failure reads -----------------------------------------------------------------------


def test_a_failure_names_kind_who_leaked_to_whom_request_excerpt_and_report(
    tmp_path: Path,
) -> None:
    leaks = [leak("t1-r1", "t0-r0")] * (MAX_FINDINGS_SHOWN + 2)
    run = write_run(
        tmp_path,
        [Req("t0-r0", 1000), Req("t1-r1", POOL + 1, "reject", "probe", prompt_tokens=1)],
        leaks,
    )
    check = CHECKS_BY_NAME["no_leak_at_or_above_limits"]
    text = describe(check, check(run))
    assert text.startswith("kvcanary check 3 failed: no response at or above the limits")
    assert "cross_tenant_canary (critical) t1-r1 [tenant-1 <- tenant-0's t0-r0]" in text
    assert "request: 2657 tokens (2657, expected reject), HTTP 200, usage.prompt_tokens=1" in text
    assert "excerpt: [… 3 chars redacted …]ydk one two" in text
    assert text.count("cross_tenant_canary (critical)") == MAX_FINDINGS_SHOWN
    assert "... and 2 more finding(s)" in text
    assert text.endswith(f"report: {tmp_path / 'report.html'}")


def test_contention_larger_than_the_bar_margin_skips_check_6_as_not_judged(
    tmp_path: Path,
) -> None:
    # a clean line where a few answers waited 1.5 s in a queue: a skipped prefill delayed
    # that much would clear the bar at the largest prompt, so passing it would prove nothing
    requests = linear_ttfts(noise_ms=2.0)
    for i in (2, 7, 11, 16):
        requests[i] = dataclasses.replace(requests[i], ttft_ms=requests[i].ttft_ms + 1500.0)
    outcome = real_prefill(write_run(tmp_path, requests, []))
    assert outcome.status == "skipped"
    assert outcome.reason.startswith("not judged: contention (delays up to ")
    assert "exceed the bar's margin of " in outcome.reason
