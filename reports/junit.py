"""`junit.xml`: the run as JUnit test results, in the subset of the format CI systems share.

One `<testsuites>` with one `<testsuite name="kvcanary">`, holding:

- one testcase per check in the finding vocabulary (`kvcanary.checks`), failed when the run
  has findings of that kind, skipped when the verdict is inconclusive or the run never
  performed that check (`summary["checks_not_run"]`: an absent finding then proves
  nothing), passed otherwise;
- one testcase per listed finding (`kvcanary.findings.<kind>`), failed, carrying the
  finding's summary and its (already redacted) excerpt;
- `kvcanary.run/evidence`, an error when the verdict is inconclusive, with the reasons.

Each testcase has at most one failure, error or skipped child, which every reader accepts.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from kvcanary.harness.record.outputs import EVIDENCE_DIR, SUMMARY_NAME, Summary
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports.checks import check_states
from kvcanary.reports.findings import KIND_MEANINGS, FindingView

# Characters XML 1.0 cannot carry at all (ElementTree would write them and break the file).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def render_junit(summary: Summary, findings: list[FindingView], num_not_listed: int) -> bytes:
    verdict = summary["verdict"]
    suite = ET.Element("testsuite", name="kvcanary")
    if summary["times"]["started"]:
        suite.set("timestamp", summary["times"]["started"].removesuffix("+00:00"))
    properties = ET.SubElement(suite, "properties")
    for name in ("run_id", "verdict", "target", "model", "seed"):
        ET.SubElement(properties, "property", name=name, value=_xml_text(str(summary[name])))
    for check in check_states(summary):
        case = _case(suite, "kvcanary.checks", check.kind)
        if check.status == "found":
            meaning = KIND_MEANINGS.get(check.kind, "")
            _child(
                case,
                "failure",
                f"{check.num_findings} {check.kind} finding(s)",
                check.kind,
                meaning,
            )
        elif check.status == "unproven":
            _child(case, "skipped", check.why)
        elif check.status != "passed":
            _child(case, "skipped", f"{check.status}: {check.why}")
    for view in findings:
        case = _case(suite, f"kvcanary.findings.{view.kind}", _finding_name(view))
        _child(case, "failure", view.summary, view.kind, _finding_text(view))
    if num_not_listed:
        case = _case(suite, "kvcanary.findings", "findings not listed individually")
        _child(
            case,
            "failure",
            f"{num_not_listed} more finding(s); see {EVIDENCE_DIR}/ and {SUMMARY_NAME}",
            "findings",
        )
    evidence = _case(suite, "kvcanary.run", "evidence")
    if verdict == Verdict.INCONCLUSIVE:
        _child(evidence, "error", "; ".join(summary["verdict_reasons"]), str(verdict))
    cases = suite.findall("testcase")
    counts = {
        "tests": len(cases),
        "failures": sum(case.find("failure") is not None for case in cases),
        "errors": sum(case.find("error") is not None for case in cases),
        "skipped": sum(case.find("skipped") is not None for case in cases),
    }
    for name, value in counts.items():
        suite.set(name, str(value))
    suite.set("time", f"{summary['times']['duration_s'] or 0:.3f}")
    root = ET.Element("testsuites", name="kvcanary")
    for name in ("tests", "failures", "errors"):
        root.set(name, str(counts[name]))
    root.append(suite)
    ET.indent(root)
    document: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return document + b"\n"


def _case(suite: ET.Element, classname: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")


def _child(
    case: ET.Element, tag: str, message: str, type_: str | None = None, text: str | None = None
) -> None:
    child = ET.SubElement(case, tag, message=_one_line(message))
    if type_ is not None:
        child.set("type", type_)
    if text:
        child.text = _xml_text(text)


def _finding_name(view: FindingView) -> str:
    return f"#{view.number} {view.kind} {view.request_id or '(run)'}"


def _finding_text(view: FindingView) -> str:
    lines = [
        view.summary,
        f"kind: {view.kind} ({view.meaning})",
        f"severity: {view.severity}; detector: {view.detector}",
        f"who: {view.who}",
        f"request: {view.request_id}",
    ]
    if view.victim_request_id:
        lines.append(f"victim request: {view.victim_request_id}")
    if view.excerpt:
        lines.append(f"excerpt (redacted): {view.excerpt}")
    lines += [f"{key}: {value}" for key, value in sorted(view.details.items())]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return _xml_text(" ".join(text.split())[:500])


def _xml_text(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)
