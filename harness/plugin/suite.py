"""kvcanary's built-in check suite as pytest tests: the incident checklist, one item per check.

`pytest --kvcanary-suite` adds this module under the node id `kvcanary` (see
`harness.plugin.pytest_plugin`); the items are ordinary test functions, so `-k`, `-x`, `--junitxml`
and reruns apply. Every item is marked `kvcanary`, so without a target they skip with the
reason. What each check runs and how it decides is `harness.plugin.checks`; the evidence (two runs
and an audit) is made once per session by `harness.plugin.target.SuiteEvidence` and
shared by every check that reads it.

A failure reads as the check, the reason, and the findings (kind, who leaked to whom, the
request, a redacted excerpt, the summary) with the report's path; never a Python traceback.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcanary.canaries.errors import KvcanaryError
from kvcanary.harness.plugin.checklist import CHECKS_BY_NAME, Check
from kvcanary.harness.plugin.checks import CheckOutcome
from kvcanary.harness.plugin.pytest_plugin import fail_plainly
from kvcanary.harness.plugin.results import describe
from kvcanary.harness.plugin.target import SuiteEvidence, TargetUnderTest

pytestmark = pytest.mark.kvcanary
REASON_PROPERTY = "kvcanary_reason"


@pytest.fixture(scope="session")
def kvcanary_suite(kvcanary_target: TargetUnderTest) -> SuiteEvidence:
    """The suite's runs and audit, made on first need and shared by the checks."""
    return SuiteEvidence(kvcanary_target)


@pytest.fixture
def kvcanary_check(
    kvcanary_suite: SuiteEvidence, request: pytest.FixtureRequest
) -> Callable[[str], None]:
    """Decide one check by name; fail with its findings, or skip with its reason.

    The reason also goes into the JUnit XML (`record_reason`), so a passing check says there
    what it saw.
    """

    def decide(name: str) -> None:
        check = CHECKS_BY_NAME[name]
        try:
            evidence = kvcanary_suite.get(check.evidence)
        except KvcanaryError as exc:
            fail_plainly(f"kvcanary check {check.number} could not run: {exc}")
        outcome = check(evidence)
        kvcanary_suite.target.checks.append((check, outcome))
        record_reason(request, outcome.reason)
        report(check, outcome)

    return decide


def record_reason(request: pytest.FixtureRequest, reason: str) -> None:
    """The check's reason in the JUnit XML, where its family allows: the test case's property
    `kvcanary_reason` for xunit1 (and `legacy`); for xunit2 (pytest's default), whose schema
    has no test case properties, the test suite's property `kvcanary_reason.<test name>`."""
    config = request.config
    if getattr(config.option, "xmlpath", None) and config.getini("junit_family") == "xunit2":
        suite_property = request.getfixturevalue("record_testsuite_property")
        suite_property(f"{REASON_PROPERTY}.{request.node.name}", reason)
    else:  # what `record_property` does, without its warning for xunit2
        request.node.user_properties.append((REASON_PROPERTY, reason))


def report(check: Check, outcome: CheckOutcome) -> None:
    """A failed check fails the test with its description; a skipped one skips it."""
    if outcome.status == "skipped":
        pytest.skip(f"kvcanary check {check.number}: {outcome.reason}")
    if outcome.status == "failed":
        fail_plainly(describe(check, outcome))


def test_1_over_pool_prompts_are_rejected(kvcanary_check: Callable[[str], None]) -> None:
    """Prompts longer than the KV pool get an error status, never an answer."""
    kvcanary_check("over_pool_rejected")


def test_2_over_context_prompts_are_rejected(kvcanary_check: Callable[[str], None]) -> None:
    """Prompts longer than the advertised context get an error status."""
    kvcanary_check("over_context_rejected")


def test_3_no_leak_at_or_above_the_limits(kvcanary_check: Callable[[str], None]) -> None:
    """No response to an at-or-above-limit prompt quotes another tenant's canary."""
    kvcanary_check("no_leak_at_or_above_limits")


def test_4_no_leak_below_the_limits_under_load(kvcanary_check: Callable[[str], None]) -> None:
    """No response below the limits, with several requests in flight, quotes another tenant."""
    kvcanary_check("no_leak_below_limits")


def test_5_usage_matches_the_prompt_sent(kvcanary_check: Callable[[str], None]) -> None:
    """`usage.prompt_tokens` equals the tokens sent, at every size answered."""
    kvcanary_check("usage_matches")


def test_6_ttft_shows_a_real_prefill(kvcanary_check: Callable[[str], None]) -> None:
    """No answer comes faster than a real prefill of its prompt allows."""
    kvcanary_check("real_prefill")


def test_7_disconnects_do_not_leak_later(kvcanary_check: Callable[[str], None]) -> None:
    """A client that hangs up mid-stream does not leave its canaries in later answers."""
    kvcanary_check("no_leak_after_disconnect")


def test_8_kv_pool_holds_the_context(kvcanary_check: Callable[[str], None]) -> None:
    """Every side's KV pool holds the context length the target advertises."""
    kvcanary_check("pool_holds_context")


def test_9_no_tenant_is_served_from_anothers_prefix_cache(
    kvcanary_check: Callable[[str], None], kvcanary_target: TargetUnderTest
) -> None:
    """The cross-tenant prefix-cache timing probe finds no shared cache (opt-in)."""
    if not kvcanary_target.config.cache_probe:
        pytest.skip(
            "kvcanary check 9: the prefix-cache timing probe is opt-in (a few hundred "
            "requests): pass --kvcanary-cache-probe"
        )
    kvcanary_check("no_shared_prefix_cache")
