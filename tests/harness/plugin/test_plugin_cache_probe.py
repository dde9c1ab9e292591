"""Check 9 of the built-in suite: the opt-in cross-tenant prefix-cache probe.

One pytest session (in a subprocess, as in CI) against the vulnerable engine with its prefix
cache on: check 9 must fail with the probe's findings. How the check reads a probe that
found nothing, or could not see the cache, is tested on its decision function.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest

from kvcanary.harness.plugin.checklist import CHECKS_BY_NAME
from kvcanary.harness.plugin.target import WorkloadResult
from kvcanary.harness.record.events import ProbeFinished

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow

INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
CHECK = CHECKS_BY_NAME["no_shared_prefix_cache"]


def test_check_9_fails_on_an_engine_whose_cache_every_tenant_shares(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(INI)
    result = pytester.runpytest_subprocess(
        "--kvcanary-engine=vulnerable",
        "--kvcanary-engine-prefix-cache",
        "--kvcanary-suite",
        "--kvcanary-cache-probe",
        "--kvcanary-cache-probe-trials=8",
        "--kvcanary-tenants=2",
        "--kvcanary-seed=5",
        "--kvcanary-out=runs",
        "-k",
        "test_9",
        "--junitxml=junit.xml",
        timeout=240,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "kvcanary check 9 failed: no tenant is served from another tenant's prefix cache *",
            "  * probe arm(s) were served from another tenant's prefix cache (owner -> prober: *",
            "  - shared_prefix_cache (high) [[]tenant-* <- tenant-*'s request[]]",
            "      tenant-* re-sending tenant-*'s prefix was served from cache: *",
            "  report: runs/suite-cache-probe/report.html",
        ]
    )
    assert "Traceback" not in result.stdout.str()
    assert (pytester.path / "runs" / "suite-cache-probe" / "journal.jsonl").is_file()
    cases = list(ET.parse(pytester.path / "junit.xml").getroot().iter("testcase"))
    assert [c.get("name") for c in cases] == [
        "test_9_no_tenant_is_served_from_anothers_prefix_cache"
    ]


def probed_run(verdict: str | None, reasons: list[str]) -> WorkloadResult:
    probes = {}
    if verdict is not None:
        details = {"assessment": {"verdict": verdict, "reasons": reasons}}
        probes["cache_probe"] = ProbeFinished("cache_probe", verdict, details, 0.0)
    return WorkloadResult(
        label="suite-cache-probe",
        out_dir=Path("runs/suite-cache-probe"),
        verdict="clean",
        reasons=(),
        summary={},
        findings=[],
        observations=pd.DataFrame(),
        findings_table=pd.DataFrame(),
        ended="completed",
        probes=probes,
    )


def test_a_probe_that_verified_isolation_passes() -> None:
    outcome = CHECK(probed_run("clean", ["the positive control shows a working cache"]))
    assert outcome.status == "passed"
    assert outcome.reason == "the positive control shows a working cache"


def test_a_probe_that_could_not_see_the_cache_skips_and_says_why() -> None:
    outcome = CHECK(probed_run("inconclusive", ["the positive control failed: ..."]))
    assert outcome.status == "skipped"
    assert outcome.reason.startswith("isolation unverifiable: the positive control failed")


def test_a_run_without_a_probe_verdict_is_inconclusive() -> None:
    outcome = CHECK(probed_run(None, []))
    assert outcome.status == "failed"
    assert outcome.reason.startswith("inconclusive")
