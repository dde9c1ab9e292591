"""The built-in suite against the bundled engine, through pytest as a user runs it.

Two sessions, one per preset, each starting the engine once and sharing two runs and an
audit between its checks (check 9, the opt-in prefix-cache probe, skips here). The
vulnerable engine must fail the over-pool, leak, timing and pool checks (1, 3, 6, 8) with
readable findings and pass the others: its over-context prompts are refused, its usage is
decode's honest count (the router relays it, as SGLang's do), nothing leaks below the
limits, and its abort plans drop after the KV write has landed
(README.md, "The pytest plugin", says why). A user's own `kvcanary_run` test in the same
session reads its run as a DataFrame. The hardened engine must pass the seven others
(check 6 may skip, saying why, when TTFT noise on a busy machine hides a prefill).

Both sessions run in a subprocess: the engine's processes, signal handlers and event loops
belong to a process of their own, as in CI.
"""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TIMEOUT_S = 240
NUM_CHECKS = 9
INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
USER_TEST = """
    def test_a_user_test_reads_the_run_as_a_dataframe(kvcanary_run):
        result = kvcanary_run(requests=6, profile="limits")
        df = result.observations
        assert len(df) == 6
        pool = result.summary["limits"]["pool_tokens"]
        answered = df[(df["num_prompt_tokens"] >= pool) & (df["outcome"] == "accepted")]
        assert not answered.empty  # the vulnerable engine answers over-pool prompts
        # usage is decode's, as SGLang's routers relay it: the full prompt, not prefill's 1
        assert (answered["prompt_tokens"] == answered["num_prompt_tokens"]).all()
        assert result.verdict == "leak"
        assert "unsafe_accept" in {str(f.kind) for f in result.findings}
        assert (result.out_dir / "summary.json").is_file()
"""


def outcomes(junit: Path) -> dict[str, str]:
    """test name -> passed / failed / skipped, from pytest's own JUnit XML."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                status = {"failure": "failed", "error": "failed"}.get(tag, tag)
        results[str(case.get("name"))] = status
    return results


def run_suite(pytester: pytest.Pytester, preset: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        f"--kvcanary-engine={preset}",
        "--kvcanary-suite",
        "--kvcanary-seed=7",
        "--kvcanary-out=runs",
        "--junitxml=junit.xml",
        timeout=TIMEOUT_S,
    )


@pytest.mark.timing
def test_the_vulnerable_engine_fails_the_incident_checks_readably(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(test_user=textwrap.dedent(USER_TEST))
    result = run_suite(pytester, "vulnerable")
    found = outcomes(pytester.path / "junit.xml")
    assert found["test_a_user_test_reads_the_run_as_a_dataframe"] == "passed"
    expected = {
        "test_1_over_pool_prompts_are_rejected": "failed",
        "test_2_over_context_prompts_are_rejected": "passed",
        "test_3_no_leak_at_or_above_the_limits": "failed",
        "test_4_no_leak_below_the_limits_under_load": "passed",
        "test_5_usage_matches_the_prompt_sent": "passed",
        "test_6_ttft_shows_a_real_prefill": "failed",
        "test_7_disconnects_do_not_leak_later": "passed",
        "test_8_kv_pool_holds_the_context": "failed",
    }
    assert {name: found[name] for name in expected} == expected
    assert len(found) == NUM_CHECKS + 1
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "kvcanary check 1 failed: over-pool prompts are rejected with an error, not answered",
            "  * prompt(s) above the KV pool (* tokens) got HTTP 200 instead of an error",
            "  - unsafe_accept (critical) t*-r* [[]tenant-*[]]",
            "      request: * tokens (*, expected reject), HTTP 200, usage.prompt_tokens=*, TTFT *",
            "  report: runs/suite-incident/report.html",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "kvcanary check 3 failed: no response at or above the limits contains *",
            "  - cross_tenant_canary (critical) t*-r* [[]tenant-* <- tenant-*'s t*-r*[]]",
            "      tenant-*'s response to t*-r* contained tenant-*'s canary from request *",
            "      excerpt: *redacted*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["kvcanary check 6 failed: TTFT at the largest accepted size is consistent with a *",
         "  * the largest accepted prompt (* tokens, t*-r*) got its first token after * ms*"]
    )  # fmt: skip
    result.stdout.fnmatch_lines(["  - pool_smaller_than_context (high)"])
    assert "Traceback" not in out
    assert "pytest.fail(" not in out  # no source lines: the finding is the message
    # the session summary: every run, its verdict, its findings, its report
    result.stdout.fnmatch_lines(
        [
            "*= kvcanary =*",
            "target: the bundled reference engine (vulnerable) at http://127.0.0.1:*",
            "test_a_user_test_reads_the_run_as_a_dataframe: LEAK - *",
            "*report: runs/test_a_user_test_reads_the_run_as_a_dataframe/report.html",
            "suite-incident: LEAK - * finding(s): *",
        ]
    )
    result.stdout.fnmatch_lines(["audit: UNSAFE", "checks:", "  1 FAILED: over-pool prompts *"])
    assert (pytester.path / "runs" / "suite-incident" / "report.html").is_file()
    assert (pytester.path / "runs" / "suite-below" / "journal.jsonl").is_file()


CLASHING = ("reports", "harness", "canaries", "tenants")
"""Generic names a user's own project may hold at its top level (PyPI has `harness`, `reports`
and `canaries` too): the plugin's import names are `kvcanary.*`, so both load side by side."""

OWN_MODULES_TEST = """
    from canaries import flags
    from harness import fixtures
    from reports import weekly
    from tenants import roster


    def test_the_projects_own_packages_still_import():
        assert (weekly.NAME, fixtures.NAME, flags.NAME, roster.NAME) == (
            "reports.weekly", "harness.fixtures", "canaries.flags", "tenants.roster"
        )
"""


def make_clashing_project(pytester: pytest.Pytester) -> None:
    """A user's project whose own top-level packages share the folder names of kvcanary."""
    for package, module in zip(CLASHING, ("weekly", "fixtures", "flags", "roster"), strict=True):
        pytester.mkpydir(package)
        (pytester.path / package / f"{module}.py").write_text(f"NAME = '{package}.{module}'\n")
    pytester.makepyfile(test_own=textwrap.dedent(OWN_MODULES_TEST))


def test_the_hardened_engine_passes_every_check(pytester: pytest.Pytester) -> None:
    # the user's project has its own `reports`, `harness`, `canaries` and `tenants` packages
    pytester.makeini(INI + "pythonpath = .\n")
    make_clashing_project(pytester)
    result = run_suite(pytester, "hardened")
    found = outcomes(pytester.path / "junit.xml")
    assert found.pop("test_the_projects_own_packages_still_import") == "passed"
    assert result.ret == pytest.ExitCode.OK
    timing = found.pop("test_6_ttft_shows_a_real_prefill")
    # check 9, the prefix-cache probe, is opt-in (tests/harness/plugin/test_plugin_cache_probe.py)
    assert found.pop("test_9_no_tenant_is_served_from_anothers_prefix_cache") == "skipped"
    assert set(found.values()) == {"passed"}
    assert len(found) == NUM_CHECKS - 2
    # xunit2 (pytest's default JUnit family) keeps each check's reason as a suite property
    reasons = {
        str(prop.get("name")).removeprefix("kvcanary_reason."): str(prop.get("value"))
        for prop in ET.parse(pytester.path / "junit.xml").getroot().iter("property")
        if str(prop.get("name")).startswith("kvcanary_reason.")
    }
    assert reasons["test_1_over_pool_prompts_are_rejected"].startswith("all ")
    # On a busy 2-core machine the largest prompt the hardened engine accepts (2045 tokens,
    # about 300 ms of prefill) can drown in TTFT noise; the check then says so and skips.
    # It must never fail: every prompt was really prefilled.
    timing_reason = reasons["test_6_ttft_shows_a_real_prefill"]
    if timing == "skipped":
        assert timing_reason.startswith(("not judged: TTFT noise (", "not judged: contention ("))
    else:
        assert timing == "passed"
        assert "; a real prefill takes about" in timing_reason
    result.stdout.fnmatch_lines(["suite-incident: CLEAN - *", "audit: CLEAN"])
