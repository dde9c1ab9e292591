"""junit.xml: valid against the schema CI systems read, one testcase per check and finding."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvcanary.harness.record.finding import FindingKind
from kvcanary.reports.render import RenderResult

SCHEMA = Path(__file__).with_name("junit.xsd")


def _suite(result: RenderResult) -> ET.Element:
    root = ET.parse(result.paths["junit"]).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    return suite


@pytest.mark.parametrize("scenario", ["vulnerable", "clean", "interrupted", "unreachable"])
def test_junit_validates_and_counts_match(rendered: dict[str, RenderResult], scenario: str) -> None:
    xmlschema = pytest.importorskip("xmlschema", reason="xmlschema validates junit.xml")
    path = rendered[scenario].paths["junit"]
    xmlschema.XMLSchema(SCHEMA).validate(path)
    suite = _suite(rendered[scenario])
    cases = suite.findall("testcase")
    assert int(suite.get("tests", "")) == len(cases)
    for tag, attribute in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        assert int(suite.get(attribute, "")) == sum(case.find(tag) is not None for case in cases)


def test_schema_rejects_what_ci_cannot_read(
    rendered: dict[str, RenderResult], tmp_path: Path
) -> None:
    """The XSD is a real check: two outcomes on one testcase do not validate."""
    xmlschema = pytest.importorskip("xmlschema", reason="xmlschema validates junit.xml")
    broken = rendered["vulnerable"].paths["junit"].read_text()
    broken = broken.replace("<failure ", '<skipped message="x" /><failure ', 1)
    (tmp_path / "broken.xml").write_text(broken)
    assert not xmlschema.XMLSchema(SCHEMA).is_valid(tmp_path / "broken.xml")


def test_a_leak_fails_its_checks_and_each_finding(rendered: dict[str, RenderResult]) -> None:
    suite = _suite(rendered["vulnerable"])
    checks = {c.get("name"): c for c in suite.findall("testcase[@classname='kvcanary.checks']")}
    assert list(checks) == [str(kind) for kind in FindingKind]
    failed = {name for name, case in checks.items() if case.find("failure") is not None}
    assert failed == {
        "cross_tenant_canary",
        "unsafe_accept",
        "prompt_tokens_mismatch",
        "fast_prefill",
    }
    findings = [
        c
        for c in suite.findall("testcase")
        if c.get("classname", "").startswith("kvcanary.findings.")
    ]
    assert len(findings) == 4
    leak = next(
        c for c in findings if c.get("classname") == "kvcanary.findings.cross_tenant_canary"
    )
    failure = leak.find("failure")
    assert failure is not None
    assert "alice's canary" in failure.get("message", "")
    assert "excerpt (redacted): [redacted" in (failure.text or "")
    evidence = suite.find("testcase[@name='evidence']")
    assert evidence is not None
    assert len(evidence) == 0


def test_a_clean_run_passes_every_check_it_performed(rendered: dict[str, RenderResult]) -> None:
    suite = _suite(rendered["clean"])
    assert suite.get("failures") == "0"
    assert suite.get("errors") == "0"
    assert suite.get("tests") == str(len(FindingKind) + 1)
    # a run audits no pool and (without --cache-probe) probes no cache: absent is not clean
    skipped = {
        case.get("name"): case.find("skipped").get("message", "")  # type: ignore[union-attr]
        for case in suite.iter("testcase")
        if case.find("skipped") is not None
    }
    assert set(skipped) == {
        "pool_smaller_than_context",
        "shared_prefix_cache",
        "cache_salt_not_bound",
    }
    assert "kvcanary audit" in skipped["pool_smaller_than_context"]
    assert "--cache-probe" in skipped["shared_prefix_cache"]
    assert "--cache-probe" in skipped["cache_salt_not_bound"]


def test_an_inconclusive_run_skips_checks_and_errors(rendered: dict[str, RenderResult]) -> None:
    suite = _suite(rendered["interrupted"])
    assert suite.get("skipped") == str(len(FindingKind))
    assert suite.get("failures") == "0"
    error = suite.find("testcase[@name='evidence']/error")
    assert error is not None
    assert "before the probe phase" in error.get("message", "")
