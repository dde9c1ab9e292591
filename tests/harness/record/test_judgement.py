"""The verdict table: which findings make which verdict, and the table as users read it."""

from __future__ import annotations

import pytest

from kvcanary.harness.record.finding import KIND_RULES, FindingKind, Severity
from kvcanary.harness.record.judgement import (
    judge,
    verdict_rows,
    verdict_table_markdown,
    verdict_table_text,
)
from kvcanary.harness.record.verdict import (
    EXIT_CLEAN,
    EXIT_FINDINGS,
    EXIT_INCOMPLETE,
    Reproduction,
    Verdict,
    exit_status,
)

K = FindingKind
NOT_JUDGED = ["no victim request was accepted, so there was nothing to leak"]


@pytest.mark.parametrize(
    ("kind", "verdict"),
    [
        (K.CROSS_TENANT_CANARY, Verdict.LEAK),
        (K.CROSS_REQUEST_CANARY, Verdict.LEAK),
        (K.UNKNOWN_CANARY, Verdict.LEAK),
        (K.SHARED_PREFIX_CACHE, Verdict.LEAK),
        (K.UNSAFE_ACCEPT, Verdict.UNSAFE),
        (K.FAST_PREFILL, Verdict.UNSAFE),
        (K.PROMPT_TOKENS_MISMATCH, Verdict.UNSAFE),
        (K.POOL_SMALLER_THAN_CONTEXT, Verdict.UNSAFE),
        (K.ERROR_IN_SUCCESS, Verdict.UNSAFE),
        (K.CACHE_SALT_NOT_BOUND, Verdict.UNSAFE),
    ],
)
def test_one_finding_alone_gives_its_row_s_verdict(kind: FindingKind, verdict: Verdict) -> None:
    assert kind.verdict is verdict
    assert judge([(kind, "r1")]).verdict is verdict


def test_every_kind_has_a_row() -> None:
    assert set(KIND_RULES) == set(FindingKind)
    assert K.CACHE_SALT_NOT_BOUND.severity is Severity.HIGH
    assert "bearer secret" in K.CACHE_SALT_NOT_BOUND.meaning


def test_an_accepted_over_limit_prompt_with_a_real_prefill_is_unsafe_not_a_leak() -> None:
    judgement = judge([(K.UNSAFE_ACCEPT, "r1")])
    assert judgement.verdict is Verdict.UNSAFE
    assert "leak" not in judgement.reasons[0].split("(")[0]
    assert "no evidence that one tenant's data reached another" in judgement.reasons[0]


def test_accepted_and_faster_than_a_prefill_on_one_request_is_the_incident() -> None:
    same = judge([(K.UNSAFE_ACCEPT, "r1"), (K.FAST_PREFILL, "r1")])
    assert same.verdict is Verdict.LEAK
    assert "the incident's signature" in same.reasons[1]
    apart = judge([(K.UNSAFE_ACCEPT, "r1"), (K.FAST_PREFILL, "r2")])
    assert apart.verdict is Verdict.UNSAFE
    run_level = judge([(K.UNSAFE_ACCEPT, None), (K.FAST_PREFILL, None)])
    assert run_level.verdict is Verdict.UNSAFE


def test_what_could_not_be_judged_makes_a_run_inconclusive_unless_a_finding_decides() -> None:
    assert judge([], NOT_JUDGED).verdict is Verdict.INCONCLUSIVE
    assert judge([], NOT_JUDGED).reasons == tuple(NOT_JUDGED)
    assert judge([(K.PROMPT_TOKENS_MISMATCH, "r1")], NOT_JUDGED).verdict is Verdict.UNSAFE
    assert judge([(K.CROSS_TENANT_CANARY, "r1")], NOT_JUDGED).verdict is Verdict.LEAK
    # an error inside every 2xx tested nothing: it is said, but the run is inconclusive
    weak = judge([(K.ERROR_IN_SUCCESS, "r1")], NOT_JUDGED)
    assert weak.verdict is Verdict.INCONCLUSIVE
    assert weak.reasons[0] == NOT_JUDGED[0]
    assert "1 error_in_success" in weak.reasons[1]


def test_reasons_count_findings_by_kind_and_carry_remarks() -> None:
    judgement = judge(
        [(K.CROSS_TENANT_CANARY, "r1"), (K.CROSS_TENANT_CANARY, "r2"), (K.UNSAFE_ACCEPT, "r1")],
        remarks=["the target stopped serving for a while"],
    )
    assert judgement.reasons == (
        "3 finding(s): 2 cross_tenant_canary (a leak from another tenant), 1 unsafe_accept",
        "the target stopped serving for a while",
    )
    assert judge([], clean_reason="nothing found").reasons == ("nothing found",)


def test_a_kind_from_a_newer_version_is_a_finding_all_the_same() -> None:
    assert judge([("quantum_leak", "r1")]).verdict is Verdict.UNSAFE


def test_exit_statuses_are_mapped_once() -> None:
    assert {v: v.exit_status for v in Verdict} == {
        Verdict.LEAK: EXIT_FINDINGS,
        Verdict.UNSAFE: EXIT_FINDINGS,
        Verdict.CLEAN: EXIT_CLEAN,
        Verdict.INCONCLUSIVE: EXIT_INCOMPLETE,
    }
    assert exit_status(Verdict.CLEAN, reports_complete=False) == EXIT_INCOMPLETE
    assert exit_status(Verdict.LEAK, reports_complete=False) == EXIT_FINDINGS
    assert [r.exit_status for r in Reproduction] == [0, 1, 3]


def test_the_table_as_text_and_markdown_names_every_kind_and_verdict() -> None:
    text, markdown = verdict_table_text(), verdict_table_markdown()
    assert sorted(verdict for verdict, _ in verdict_rows()) == sorted(Verdict)
    for verdict in Verdict:
        assert f"  {verdict} " in text
        assert f"| `{verdict}` |" in markdown
    for kind, rule in KIND_RULES.items():
        assert f"| `{kind}` | {rule.severity} | `{rule.verdict}` |" in markdown
        [line] = [line for line in text.splitlines() if line.startswith(f"  {kind} ")]
        assert line.split()[1:3] == [rule.severity, rule.verdict]
    assert max(len(line) for line in text.splitlines()) <= 88
